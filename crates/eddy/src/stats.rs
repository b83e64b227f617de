//! Run statistics: timing of a generation, peak memory, and energy from the Linux powercap (RAPL) counters
//! and, with the `cuda` feature, the GPU's own energy counter (NVML).

use std::time::Duration;

/// What one generation measured. Times are wall-clock.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    /// Prompt tokens prefilled.
    pub prompt_tokens: usize,
    /// Tokens generated (sampled), including the first.
    pub generated_tokens: usize,
    /// Target forward passes made while decoding (after the prefill).
    pub decode_passes: usize,
    /// From the start of prefill to the first sampled token.
    pub ttft: Duration,
    /// The part of `ttft` spent measuring the verify-cost curve: once per engine, at its first request with a
    /// speculator (zero otherwise). Not prefill work, so [`GenerationStats::prefill_speed`] leaves it out.
    pub calibration_time: Duration,
    /// From the first sampled token to the last.
    pub decode_time: Duration,
    /// Whole call.
    pub duration: Duration,
    /// Why generation stopped.
    pub finish: FinishReason,
    /// Prompt tokens whose KV was reused from the previous request (prefix cache) instead of prefilled.
    pub cached_tokens: usize,
    /// Draft tokens proposed to the target (tree nodes below the root, over all verify passes).
    pub draft_tokens: usize,
    /// Draft tokens the target accepted.
    pub draft_accepted: usize,
    /// `accepted_at_depth[d]`: verify passes that accepted at least `d + 1` draft tokens; with
    /// `proposed_at_depth[d]` (passes whose tree reached depth `d + 1`) it gives the acceptance profile.
    pub accepted_at_depth: Vec<usize>,
    /// Verify passes whose tree reached depth `d + 1`.
    pub proposed_at_depth: Vec<usize>,
    /// Part of `decode_time` spent before each verify pass: the speculators' proposals and the tree's
    /// selection.
    pub draft_time: Duration,
    /// Part of `decode_time` spent in the target's decode and verify passes (their logits or token ids
    /// back on the host).
    pub verify_time: Duration,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token.
    #[default]
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The caller asked to stop.
    Cancelled,
}

impl GenerationStats {
    /// Prompt tokens ÷ (TTFT − the speculation calibration), tokens/s.
    pub fn prefill_speed(&self) -> f64 {
        self.prompt_tokens as f64 / self.ttft.saturating_sub(self.calibration_time).as_secs_f64().max(1e-9)
    }
    /// (generated − 1) ÷ (time of last token − time of first token), tokens/s; 0 with fewer than 2 tokens.
    pub fn generation_speed(&self) -> f64 {
        if self.generated_tokens < 2 {
            return 0.0;
        }
        (self.generated_tokens - 1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
    /// Generated tokens ÷ decode forward passes (the first token comes from the prefill pass).
    pub fn tokens_per_pass(&self) -> f64 {
        if self.decode_passes == 0 {
            return if self.generated_tokens > 0 { 1.0 } else { 0.0 };
        }
        (self.generated_tokens.saturating_sub(1)) as f64 / self.decode_passes as f64
    }
}

/// Peak resident set size of this process in bytes (`VmHWM` of /proc/self/status), if readable.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Reads cumulative package energy from `/sys/class/powercap/intel-rapl:N/energy_uj` (µJ), handling the
/// counter's wrap at `max_energy_range_uj` (AMD exposes the same files), plus, for a model on a GPU, the GPU's
/// total energy counter (NVML `nvmlDeviceGetTotalEnergyConsumption`, mJ since the driver loaded; needs the
/// `cuda` feature and libnvidia-ml at run time). The total is the sum of the counters that could be read.
pub struct EnergyMeter {
    zones: Vec<(std::path::PathBuf, u64, u64)>, // (energy file, max range, value at start)
    #[cfg(feature = "cuda")]
    gpu: Option<GpuEnergy>,
}

/// The GPU's NVML energy counter (mJ) and its value at the start.
#[cfg(feature = "cuda")]
struct GpuEnergy {
    nvml: nvml_wrapper::Nvml,
    pci_bus_id: String,
    start_mj: u64,
}

#[cfg(feature = "cuda")]
impl GpuEnergy {
    /// The counter of the GPU at `pci_bus_id`; None when NVML, the device or its counter is unavailable.
    fn start(pci_bus_id: &str) -> Option<GpuEnergy> {
        let nvml = nvml_wrapper::Nvml::init().ok()?;
        let start_mj = nvml.device_by_pci_bus_id(pci_bus_id).ok()?.total_energy_consumption().ok()?;
        Some(GpuEnergy { nvml, pci_bus_id: pci_bus_id.to_string(), start_mj })
    }
    fn millijoules(&self) -> u64 {
        let now = self.nvml.device_by_pci_bus_id(self.pci_bus_id.as_str()).and_then(|d| d.total_energy_consumption());
        now.map_or(0, |v| v.saturating_sub(self.start_mj))
    }
}

impl EnergyMeter {
    /// Start measuring the CPU packages; `Err(reason)` when no counter can be read (not Linux, no RAPL, not
    /// root, VM).
    pub fn start() -> Result<Self, String> {
        Self::start_with_gpu(None)
    }

    /// Start measuring the CPU packages and, when `gpu_pci_bus_id` names the GPU the model runs on, that GPU
    /// (NVML; an absent library or counter leaves it out, never an error). `Err(reason)` when no counter at
    /// all can be read.
    pub fn start_with_gpu(gpu_pci_bus_id: Option<&str>) -> Result<Self, String> {
        #[cfg(feature = "cuda")]
        let gpu = gpu_pci_bus_id.and_then(GpuEnergy::start);
        #[cfg(not(feature = "cuda"))]
        let _ = gpu_pci_bus_id;
        let zones = Self::rapl_zones();
        #[cfg(feature = "cuda")]
        if gpu.is_some() {
            return Ok(EnergyMeter { zones: zones.unwrap_or_default(), gpu });
        }
        Ok(EnergyMeter {
            zones: zones?,
            #[cfg(feature = "cuda")]
            gpu,
        })
    }

    /// What is measured, e.g. "CPU (RAPL) + GPU (NVML)".
    pub fn sources(&self) -> String {
        let mut s = Vec::new();
        if !self.zones.is_empty() {
            s.push("CPU (RAPL)");
        }
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            s.push("GPU (NVML)");
        }
        s.join(" + ")
    }

    fn rapl_zones() -> Result<Vec<(std::path::PathBuf, u64, u64)>, String> {
        let base = std::path::Path::new("/sys/class/powercap");
        let entries = std::fs::read_dir(base).map_err(|_| "no RAPL counters (/sys/class/powercap absent)".to_string())?;
        let mut zones = Vec::new();
        let mut denied = false;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            // Top-level package zones only (intel-rapl:0, intel-rapl:1), not sub-zones (intel-rapl:0:0).
            if !(name.starts_with("intel-rapl:") && name.matches(':').count() == 1) {
                continue;
            }
            let f = e.path().join("energy_uj");
            match std::fs::read_to_string(&f) {
                Ok(v) => {
                    let max = std::fs::read_to_string(e.path().join("max_energy_range_uj"))
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .unwrap_or(u64::MAX);
                    if let Ok(v) = v.trim().parse() {
                        zones.push((f, max, v));
                    }
                }
                Err(_) => denied = true,
            }
        }
        if zones.is_empty() {
            return Err(if denied { "RAPL counters not readable (needs root)".into() } else { "no RAPL package counters".into() });
        }
        Ok(zones)
    }

    /// Joules used since `start`.
    pub fn joules(&self) -> f64 {
        let mut uj = 0u64;
        for (f, max, start) in &self.zones {
            let now: u64 = std::fs::read_to_string(f).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(*start);
            uj += if now >= *start { now - start } else { max - start + now };
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            uj += 1000 * g.millijoules();
        }
        uj as f64 * 1e-6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unavailable_gpu_counter_is_left_out_not_an_error() {
        // No GPU answers at this PCI address (and without NVML none at all): the meter is what the CPU
        // counters alone give.
        let plain = EnergyMeter::start();
        let with = EnergyMeter::start_with_gpu(Some("0000:ff:1f.7"));
        assert_eq!(plain.is_ok(), with.is_ok());
        if let Ok(m) = with {
            assert_eq!(m.sources(), "CPU (RAPL)");
            assert!(m.joules() >= 0.0);
        }
    }
}
