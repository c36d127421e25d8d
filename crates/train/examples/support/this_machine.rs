//! The planner on this machine, shared by the layout benchmarks (`layouts`, `expert_layouts`):
//! a cluster of "this-machine" devices whose peak is the measured GEMM rate and whose link is
//! the group's measured shared memory, a prediction of tokens/s for one layout, and the
//! efficiency fitted so the planner matches one measured run, and the table of measured
//! against predicted tokens/s.

use plan::cluster::{Cluster, ClusterFile, DeviceOverride};
use plan::hardware::THIS_MACHINE;
use plan::job::{Job, JobFile};
use plan::layout::Layout;

/// The planner's view of this machine and one job (a TOML `[model]`/`[training]` text).
pub struct Planner {
    job_toml: String,
    cluster: ClusterFile,
    /// FLOP/s per device.
    peak: f64,
    /// (α s, β bytes/s) between devices.
    link: (f64, f64),
}

impl Planner {
    /// `peak` FLOP/s per device, `link` the measured (α s, β bytes/s) between devices.
    pub fn new(job_toml: String, peak: f64, link: (f64, f64)) -> Planner {
        let mut cf = ClusterFile::preset(THIS_MACHINE, 1);
        cf.device_override = Some(DeviceOverride {
            bf16_tflops: Some(peak / 1e12),
            fp8_tflops: Some(0.0),
            fp32_tflops: Some(peak / 1e12),
            tf32_tflops: Some(peak / 1e12),
            hbm_gb: Some(8.0),
            hbm_tbs: Some(0.01),
            power_w: Some(0.0),
        });
        cf.intra = Some("pcie4".into());
        cf.intra_alpha_us = Some(link.0 * 1e6);
        cf.intra_bw_gbs = Some(link.1 / 1e9);
        cf.memory_reserve_gb = 0.0;
        Planner {
            job_toml,
            cluster: cf,
            peak,
            link,
        }
    }

    /// Predicted tokens/s of `l` (one node of `l.devices()` devices) at `efficiency`.
    pub fn tokens_per_s(
        &self,
        efficiency: f64,
        l: &Layout,
    ) -> Result<f64, Box<dyn std::error::Error>> {
        let mut jf = JobFile::from_toml(&self.job_toml)?;
        jf.training.efficiency = efficiency;
        let job = Job::from_file(&jf)?;
        let mut cf = self.cluster.clone();
        cf.devices_per_node = l.devices();
        let cluster = Cluster::from_file(&cf)?;
        Ok(plan::step::evaluate(&job, &cluster, l)?.tokens_per_s)
    }

    /// The efficiency at which `l` is predicted at `measured` tokens/s: tokens/s is
    /// proportional to the efficiency while compute dominates, so one rescale fits it and a
    /// second corrects what the memory and communication terms bend.
    pub fn fit(&self, measured: f64, l: &Layout) -> Result<f64, Box<dyn std::error::Error>> {
        let mut eff = 0.5;
        for _ in 0..2 {
            eff *= measured / self.tokens_per_s(eff, l)?;
        }
        Ok(eff)
    }

    /// Prints the run's setup (`steps`, a global batch of `rows` x `seq` tokens, this machine's
    /// peak and link, the fitted `efficiency`), then each `(name, seconds per step, layout)`
    /// run's measured tokens/s beside the planner's prediction, and how far off it is.
    pub fn print_beside(
        &self,
        efficiency: f64,
        steps: impl std::fmt::Display,
        (rows, seq): (usize, usize),
        runs: &[(&str, f64, Layout)],
    ) -> Result<(), Box<dyn std::error::Error>> {
        println!(
            "# {steps} steps (the first untimed), global batch {rows} x {seq} tokens, GEMM peak {:.1} GFLOP/s, shm alpha {:.2} us beta {:.2} GB/s, fitted efficiency {efficiency:.3}",
            self.peak / 1e9,
            self.link.0 * 1e6,
            self.link.1 / 1e9
        );
        let tokens = (rows * seq) as f64;
        println!("layout  measured tokens/s  planner tokens/s  off");
        for (name, secs, l) in runs {
            let measured = tokens / secs;
            let planned = self.tokens_per_s(efficiency, l)?;
            println!(
                "{name:<6}  {measured:>17.0}  {planned:>16.0}  {:+.1}%",
                100.0 * (planned - measured) / measured
            );
        }
        Ok(())
    }
}

/// Mean of `secs` without the first (untimed warm-up) entry.
pub fn mean_after_first(secs: &[f64]) -> f64 {
    let timed = &secs[1.min(secs.len())..];
    timed.iter().sum::<f64>() / timed.len().max(1) as f64
}
