//! A reader for GGUF files (versions 2 and 3), the llama.cpp model format.
//!
//! GGUF is an *import* format for eddy: the file is memory-mapped, its header, key/value metadata and tensor
//! table are parsed and bounds-checked, and tensor bytes are handed to [`crate::quant::import`] which converts
//! them into eddy's own weight formats. Layout (little endian): magic `GGUF`, u32 version, u64 tensor count,
//! u64 metadata count, metadata key/values, tensor infos (name, n_dims, dims, ggml type, offset), padding to
//! `general.alignment` (default 32), then the tensor data section. Source: the GGUF specification in the
//! ggml repository (docs/gguf.md).

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) if v >= 0 => Some(v as u64),
            GgufValue::I16(v) if v >= 0 => Some(v as u64),
            GgufValue::I32(v) if v >= 0 => Some(v as u64),
            GgufValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    /// The value as a signed integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    /// The value as a float (integers convert).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor type ids (the subset eddy knows by name; others are reported by number).
pub mod ggml_type {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q4_1: u32 = 3;
    pub const Q5_0: u32 = 6;
    pub const Q5_1: u32 = 7;
    pub const Q8_0: u32 = 8;
    pub const Q8_1: u32 = 9;
    pub const Q2_K: u32 = 10;
    pub const Q3_K: u32 = 11;
    pub const Q4_K: u32 = 12;
    pub const Q5_K: u32 = 13;
    pub const Q6_K: u32 = 14;
    pub const Q8_K: u32 = 15;
    pub const BF16: u32 = 30;

    /// Human name of a ggml type id.
    pub fn name(t: u32) -> String {
        match t {
            F32 => "F32".into(),
            F16 => "F16".into(),
            Q4_0 => "Q4_0".into(),
            Q4_1 => "Q4_1".into(),
            Q5_0 => "Q5_0".into(),
            Q5_1 => "Q5_1".into(),
            Q8_0 => "Q8_0".into(),
            Q8_1 => "Q8_1".into(),
            Q2_K => "Q2_K".into(),
            Q3_K => "Q3_K".into(),
            Q4_K => "Q4_K".into(),
            Q5_K => "Q5_K".into(),
            Q6_K => "Q6_K".into(),
            Q8_K => "Q8_K".into(),
            BF16 => "BF16".into(),
            other => format!("ggml type {other}"),
        }
    }

    /// (values per block, bytes per block) of the types whose size eddy knows.
    pub fn block_size(t: u32) -> Option<(usize, usize)> {
        Some(match t {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            _ => return None,
        })
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous one (columns / input features of a matrix).
    pub dims: Vec<u64>,
    /// ggml type id, see [`ggml_type`].
    pub ggml_type: u32,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Byte length of the data (derived from dims and type).
    pub nbytes: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An open, memory-mapped GGUF file.
pub struct GgufFile {
    /// The file's path (for error messages).
    pub path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// All key/value metadata.
    pub metadata: BTreeMap<String, GgufValue>,
    /// The tensor table, in file order.
    pub tensors: Vec<TensorInfo>,
    mmap: memmap2::Mmap,
    data_offset: usize,
}

/// A string read from a file, fit for an error message: at most [`SHOWN_CHARS`] characters (`…` marks a
/// cut), quoted and escaped as Rust's `{:?}` writes it, so that control characters and terminal escape
/// sequences in a corrupted file are printed as text.
pub fn shown(s: &str) -> String {
    match s.char_indices().nth(SHOWN_CHARS) {
        Some((i, _)) => format!("{:?}…", &s[..i]),
        None => format!("{s:?}"),
    }
}

/// Most characters of a file's string that [`shown`] prints.
pub const SHOWN_CHARS: usize = 64;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn truncated(&self, what: &str) -> Error {
        Error::model(self.path, format!("truncated GGUF file: ends while reading {what} at byte {}", self.pos))
    }
    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| self.truncated(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.buf.len() as u64 {
            return Err(self.truncated(what));
        }
        let b = self.bytes(n as usize, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| Error::model(self.path, format!("corrupt GGUF file: {what} is not UTF-8")))
    }
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.bytes(1, what)?[0]),
            1 => GgufValue::I8(self.bytes(1, what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.bytes(2, what)?.try_into().unwrap())),
            3 => GgufValue::I16(i16::from_le_bytes(self.bytes(2, what)?.try_into().unwrap())),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(self.u32(what)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(what)?)),
            7 => GgufValue::Bool(self.bytes(1, what)?[0] != 0),
            8 => GgufValue::String(self.string(what)?),
            9 if depth == 0 => {
                let elem_ty = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the file is corruption.
                if n > (self.buf.len() - self.pos) as u64 {
                    return Err(self.truncated(what));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, what, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(what)?)),
            _ => return Err(Error::model(self.path, format!("corrupt GGUF file: unknown value type {ty} in {what}"))),
        })
    }
}

impl GgufFile {
    /// Open and parse `path`. Errors (as [`Error::Model`] naming the file): missing file, wrong magic,
    /// unsupported version, truncated header or data, tensor data out of bounds.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::model(path, format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only; a file truncated by another process while mapped would fault, as with
        // every mmap-based loader. Bounds are checked against the length at open.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::model(path, format!("cannot map: {e}")))?;
        let mut r = Reader { buf: &mmap, pos: 0, path };
        let magic = r.bytes(4, "magic").map_err(|_| Error::model(path, "not a GGUF file (shorter than 4 bytes)"))?;
        if magic != b"GGUF" {
            return Err(Error::model(path, format!("not a GGUF file (magic {:?}, expected \"GGUF\")", String::from_utf8_lossy(magic))));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::model(path, format!("unsupported GGUF version {version} (eddy reads 2 and 3)")));
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        if n_tensors > r.buf.len() as u64 || n_kv > r.buf.len() as u64 {
            return Err(Error::model(path, "corrupt GGUF header: impossible tensor or metadata count"));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let what = format!("metadata {}", shown(&key));
            let ty = r.u32(&what)?;
            let v = r.value(ty, &what, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor name #{i}"))?;
            let what = format!("tensor {}", shown(&name));
            let n_dims = r.u32(&what)?;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::model(path, format!("corrupt {what}: {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&what)?);
            }
            let ggml_type = r.u32(&what)?;
            let offset = r.u64(&what)?;
            let n: u64 = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
            let nbytes = match ggml_type::block_size(ggml_type) {
                Some((bv, bb)) => {
                    if !n.is_multiple_of(bv as u64) {
                        return Err(Error::model(
                            path,
                            format!("corrupt {what}: {n} values is not a whole number of {} blocks", ggml_type::name(ggml_type)),
                        ));
                    }
                    (n / bv as u64).saturating_mul(bb as u64)
                }
                None => 0, // unknown type: reported when the tensor is used
            };
            tensors.push(TensorInfo { name, dims, ggml_type, offset, nbytes });
        }
        let align = metadata.get("general.alignment").and_then(|v| v.as_u64()).unwrap_or(32) as usize;
        if align == 0 || !align.is_power_of_two() {
            return Err(Error::model(path, format!("corrupt GGUF: general.alignment = {align}")));
        }
        let data_offset = r.pos.div_ceil(align) * align;
        let data_len = mmap.len().saturating_sub(data_offset) as u64;
        // Tensors lie back to back in their listed order, each padded to the alignment (as the
        // specification's writers lay them out and llama.cpp's reader requires): any other offset is
        // a corrupt header, not a layout to honour.
        let mut expected = 0u64;
        let mut prev: Option<&TensorInfo> = None;
        for t in &tensors {
            if t.offset != expected {
                // An unknown type before it has no known size: name that, not the offset it threw off.
                if let Some(p) = prev.filter(|p| ggml_type::block_size(p.ggml_type).is_none()) {
                    return Err(Error::model(
                        path,
                        format!(
                            "tensor {} has ggml type {}, which eddy does not know (a newer or corrupt GGUF file)",
                            shown(&p.name),
                            p.ggml_type
                        ),
                    ));
                }
                return Err(Error::model(
                    path,
                    format!("corrupt GGUF: tensor {} has data offset {}, expected {expected}", shown(&t.name), t.offset),
                ));
            }
            expected = t.offset.saturating_add(t.nbytes).div_ceil(align as u64).saturating_mul(align as u64);
            prev = Some(t);
        }
        for t in &tensors {
            if t.offset.checked_add(t.nbytes).is_none_or(|end| end > data_len) {
                return Err(Error::model(
                    path,
                    format!(
                        "truncated GGUF file: tensor {} needs bytes up to {} of the data section, which has {data_len}",
                        shown(&t.name),
                        t.offset.saturating_add(t.nbytes)
                    ),
                ));
            }
        }
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, mmap, data_offset })
    }

    /// Metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A required metadata value, or an error naming the key.
    pub fn require(&self, key: &str) -> Result<&GgufValue> {
        self.get(key).ok_or_else(|| Error::model(&self.path, format!("missing metadata key {key}")))
    }

    /// A required unsigned integer.
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.require(key)?.as_u64().ok_or_else(|| Error::model(&self.path, format!("metadata {key} is not an unsigned integer")))
    }

    /// A required float.
    pub fn require_f64(&self, key: &str) -> Result<f64> {
        self.require(key)?.as_f64().ok_or_else(|| Error::model(&self.path, format!("metadata {key} is not a number")))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        let arch = self
            .require("general.architecture")?
            .as_str()
            .ok_or_else(|| Error::model(&self.path, "general.architecture is not a string"))?;
        // Architecture names are short identifiers; anything else is corruption (and would be printed raw
        // by the unknown-architecture message).
        if arch.is_empty() || arch.len() > SHOWN_CHARS || !arch.chars().all(|c| c.is_ascii_graphic()) {
            return Err(Error::model(&self.path, format!("corrupt GGUF file: general.architecture {} is not a name", shown(arch))));
        }
        Ok(arch)
    }

    /// Tensor info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (bounds were checked at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8]> {
        if ggml_type::block_size(t.ggml_type).is_none() {
            return Err(Error::model(
                &self.path,
                format!("tensor {} has unsupported type {}", shown(&t.name), ggml_type::name(t.ggml_type)),
            ));
        }
        let start = self.data_offset + t.offset as usize;
        Ok(&self.mmap[start..start + t.nbytes as usize])
    }

    /// Total size of the mapped file in bytes.
    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }
}

/// Write a GGUF v3 file: `metadata` in key order, then the tensor table and data of `tensors`
/// (`(name, ggml dims, ggml type, raw bytes)`), aligned to `general.alignment` (default 32).
/// Used by tests to build malformed or modified models and by exporters.
pub fn write_gguf(path: &Path, metadata: &BTreeMap<String, GgufValue>, tensors: &[(String, Vec<u64>, u32, &[u8])]) -> std::io::Result<()> {
    fn put_str(b: &mut Vec<u8>, s: &str) {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }
    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }
    fn put_val(b: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => b.push(*x),
            GgufValue::I8(x) => b.push(*x as u8),
            GgufValue::U16(x) => b.extend(x.to_le_bytes()),
            GgufValue::I16(x) => b.extend(x.to_le_bytes()),
            GgufValue::U32(x) => b.extend(x.to_le_bytes()),
            GgufValue::I32(x) => b.extend(x.to_le_bytes()),
            GgufValue::F32(x) => b.extend(x.to_le_bytes()),
            GgufValue::Bool(x) => b.push(*x as u8),
            GgufValue::String(s) => put_str(b, s),
            GgufValue::Array(a) => {
                b.extend(a.first().map(type_id).unwrap_or(4).to_le_bytes());
                b.extend((a.len() as u64).to_le_bytes());
                for e in a {
                    put_val(b, e);
                }
            }
            GgufValue::U64(x) => b.extend(x.to_le_bytes()),
            GgufValue::I64(x) => b.extend(x.to_le_bytes()),
            GgufValue::F64(x) => b.extend(x.to_le_bytes()),
        }
    }
    let align = metadata.get("general.alignment").and_then(|v| v.as_u64()).unwrap_or(32) as usize;
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut b, k);
        b.extend(type_id(v).to_le_bytes());
        put_val(&mut b, v);
    }
    let mut offset = 0usize;
    for (name, dims, ty, data) in tensors {
        put_str(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend((offset as u64).to_le_bytes());
        offset = (offset + data.len()).div_ceil(align) * align;
    }
    b.resize(b.len().div_ceil(align) * align, 0);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    std::io::Write::write_all(&mut f, &b)?;
    for (_, _, _, data) in tensors {
        std::io::Write::write_all(&mut f, data)?;
        let pad = data.len().div_ceil(align) * align - data.len();
        std::io::Write::write_all(&mut f, &vec![0u8; pad])?;
    }
    std::io::Write::flush(&mut f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_kv_str(out: &mut Vec<u8>, k: &str, v: &str) {
        out.extend((k.len() as u64).to_le_bytes());
        out.extend(k.as_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }

    /// A minimal valid GGUF: one metadata key, one 32-value F32 tensor.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        write_kv_str(&mut b, "general.architecture", "llama");
        let name = "x.weight";
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend(1u32.to_le_bytes());
        b.extend(32u64.to_le_bytes());
        b.extend(ggml_type::F32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        for i in 0..32 {
            b.extend((i as f32 * 0.5).to_le_bytes());
        }
        b
    }

    fn open_bytes(bytes: &[u8]) -> Result<GgufFile> {
        // A file of its own per call: tests run in parallel, several with files of the same length.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("eddy-gguf-test-{}-{n}", std::process::id()));
        std::fs::write(&dir, bytes).unwrap();
        let r = GgufFile::open(&dir);
        std::fs::remove_file(&dir).ok();
        r
    }

    #[test]
    fn parses_tiny_file() {
        let f = open_bytes(&tiny_gguf()).unwrap();
        assert_eq!(f.architecture().unwrap(), "llama");
        let t = f.tensor("x.weight").unwrap();
        assert_eq!(t.dims, vec![32]);
        let d = f.tensor_data(t).unwrap();
        assert_eq!(f32::from_le_bytes(d[4..8].try_into().unwrap()), 0.5);
    }

    /// A tensor whose data offset is not where the layout puts it (here: one byte off) is refused.
    #[test]
    fn moved_tensor_offset_is_refused() {
        let mut b = tiny_gguf();
        let at = b.windows(8).position(|w| w == b"x.weight").unwrap() + 8 + 4 + 8 + 4;
        b[at..at + 8].copy_from_slice(&1u64.to_le_bytes());
        b.extend([0u8; 32]);
        let msg = open_bytes(&b).err().expect("a moved offset was accepted").to_string();
        assert!(msg.contains("corrupt GGUF") && msg.contains("offset 1, expected 0"), "{msg}");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = tiny_gguf();
        for len in 0..full.len() {
            let e = open_bytes(&full[..len]).err().unwrap_or_else(|| panic!("length {len} accepted"));
            let msg = e.to_string();
            assert!(msg.contains("GGUF"), "{len}: {msg}");
        }
    }

    #[test]
    fn wrong_magic() {
        let mut b = tiny_gguf();
        b[0] = b'X';
        assert!(open_bytes(&b).err().unwrap().to_string().contains("not a GGUF file"));
    }

    #[test]
    fn write_then_read_round_trip() {
        let f = open_bytes(&tiny_gguf()).unwrap();
        let t = f.tensor("x.weight").unwrap().clone();
        let data = f.tensor_data(&t).unwrap().to_vec();
        let p = std::env::temp_dir().join(format!("eddy-gguf-rt-{}", std::process::id()));
        write_gguf(&p, &f.metadata, &[(t.name.clone(), t.dims.clone(), t.ggml_type, &data)]).unwrap();
        let g = GgufFile::open(&p).unwrap();
        std::fs::remove_file(&p).ok();
        assert_eq!(g.metadata, f.metadata);
        assert_eq!(g.tensor_data(g.tensor("x.weight").unwrap()).unwrap(), &data[..]);
    }

    #[test]
    fn missing_file() {
        let e = GgufFile::open(Path::new("/nonexistent/model.gguf")).err().unwrap().to_string();
        assert!(e.starts_with("/nonexistent/model.gguf: cannot open"), "{e}");
    }

    #[test]
    fn file_strings_in_errors_are_escaped_and_truncated() {
        // A tensor name of control bytes and 200 characters, with an impossible dimension count.
        let mut b = tiny_gguf();
        let name = format!("\x1b[31m{}", "a".repeat(200));
        let at = b.windows(8).position(|w| w == b"x.weight").unwrap();
        b.splice(at - 8..at + 8, (name.len() as u64).to_le_bytes().into_iter().chain(name.bytes()));
        let dims_at = at - 8 + 8 + name.len();
        b[dims_at..dims_at + 4].copy_from_slice(&9u32.to_le_bytes());
        let msg = open_bytes(&b).err().unwrap().to_string();
        assert!(msg.contains("9 dimensions"), "{msg}");
        assert!(!msg.contains('\x1b') && msg.contains("\\u{1b}[31m"), "{msg}");
        assert!(!msg.contains(&"a".repeat(65)) && msg.contains(&"a".repeat(50)), "{msg}");
        assert_eq!(shown("ab\n"), "\"ab\\n\"");
        assert_eq!(shown(&"é".repeat(70)), format!("{:?}…", "é".repeat(64)));
    }
}
