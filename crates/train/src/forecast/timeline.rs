//! One compute stream beside one communication stream: the fleet law's overlap term
//! (000 F2, `T_step = T_compute + T_comm − T_overlap`) played out op by op instead of assumed.
//!
//! The group's background worker runs collectives one at a time in issue order (a FIFO), so an
//! op starts when both it has been issued and the previous op has finished. The compute stream
//! stalls only where it waits for an op that has not finished: that wait is the exposed
//! communication the trainer measures.
//!
//! A collective also starts only once every rank has issued it. Ranks run the same compute
//! with independent noise, so they drift apart until a wait that blocks lines them up again;
//! the last of `N` issues a collective, on average, `e_N · σ` after the mean, where σ is the
//! spread of the compute since that last blocking wait and `e_N` the expected maximum of `N`
//! standard normal values (0.56 for two ranks).

/// Seconds on the two streams of one simulated step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timeline {
    now: f64,
    comm_free: f64,
    compute: f64,
    comm: f64,
    exposed: f64,
    /// Variance of the compute since the ranks were last lined up by a blocking wait.
    var: f64,
    /// `e_N` for this many ranks.
    straggle: f64,
    /// Seconds the blocking waits were held back for the last rank, summed.
    skew: f64,
    /// Every core runs compute: the communication's own CPU work (copies, reductions) is taken
    /// from the compute stream.
    saturated: bool,
}

/// A collective in flight: when it will have finished, and how late its last rank issued it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Issued {
    /// Completion time.
    pub done: f64,
    /// How long after this rank the last one issued it.
    pub late: f64,
}

impl Timeline {
    /// An empty step at time 0 on `ranks` ranks.
    pub fn new(ranks: usize) -> Timeline {
        Timeline {
            straggle: expected_max_normal(ranks),
            ..Timeline::default()
        }
    }

    /// The same with every core busy computing: each collective's time is CPU time the compute
    /// stream loses (it overlaps nothing; it only moves where the time is spent).
    pub fn saturated(ranks: usize) -> Timeline {
        Timeline {
            saturated: true,
            ..Timeline::new(ranks)
        }
    }

    /// Runs `seconds` of compute.
    pub fn compute(&mut self, seconds: f64) {
        self.now += seconds;
        self.compute += seconds;
    }

    /// Runs compute of mean `seconds` and variance `var` on each rank.
    pub fn compute_noisy(&mut self, seconds: f64, var: f64) {
        self.compute(seconds);
        self.var += var;
    }

    /// Issues a collective of `seconds` now. It starts after the previous op, and after the
    /// last rank has issued it too.
    pub fn issue(&mut self, seconds: f64) -> Issued {
        let late = self.straggle * self.var.sqrt();
        let start = self.comm_free.max(self.now + late);
        self.comm_free = start + seconds;
        self.comm += seconds;
        if self.saturated {
            self.compute(seconds);
        }
        Issued {
            done: self.comm_free,
            late,
        }
    }

    /// Blocks the compute stream until `op` has finished. A wait that blocks lines the ranks up
    /// again: the drift starts afresh.
    pub fn wait(&mut self, op: Issued) {
        if op.done > self.now {
            self.exposed += op.done - self.now;
            self.skew += op.late.min(op.done - self.now);
            self.now = op.done;
            self.var = 0.0;
        }
    }

    /// Issues a collective and waits for it at once (nothing to overlap it with).
    pub fn blocking(&mut self, seconds: f64) {
        let op = self.issue(seconds);
        self.wait(op);
    }

    /// Wall time so far.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Compute seconds so far.
    pub fn compute_s(&self) -> f64 {
        self.compute
    }

    /// Seconds the communication stream was busy (before overlap).
    pub fn comm_s(&self) -> f64 {
        self.comm
    }

    /// Seconds the compute stream waited on communication.
    pub fn exposed_s(&self) -> f64 {
        self.exposed
    }

    /// Seconds of the blocking waits spent waiting for the last rank (part of
    /// [`Timeline::exposed_s`]).
    pub fn skew_s(&self) -> f64 {
        self.skew
    }
}

/// The expected maximum of `n` independent standard normal values, `e_n`: the order-statistics
/// table to 4 digits up to 8, then Blom's approximation `Φ⁻¹((n − 0.375) / (n + 0.25))`, within
/// 1 % from 9 up.
pub fn expected_max_normal(n: usize) -> f64 {
    const TABLE: [f64; 9] = [
        0.0, 0.0, 0.5642, 0.8463, 1.0294, 1.1630, 1.2672, 1.3522, 1.4236,
    ];
    match TABLE.get(n) {
        Some(&e) => e,
        None => inverse_normal_cdf((n as f64 - 0.375) / (n as f64 + 0.25)),
    }
}

/// Φ⁻¹(p) for 0 < p < 1 by Acklam's rational approximation (relative error below 1.2e-9).
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383_577_518_672_69e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_hides_what_fits_under_compute_and_exposes_the_rest() {
        // A bucket issued with 3 s of backward left and taking 2 s: hidden.
        let mut t = Timeline::new(1);
        t.compute(1.0);
        let d = t.issue(2.0);
        t.compute(3.0);
        t.wait(d);
        assert_eq!((t.now(), t.exposed_s(), t.comm_s()), (4.0, 0.0, 2.0));
        // Two ops queue on one stream: the second starts when the first ends.
        let mut t = Timeline::new(1);
        let a = t.issue(2.0);
        let b = t.issue(2.0);
        assert_eq!((a.done, b.done), (2.0, 4.0));
        t.compute(1.0);
        t.wait(b);
        assert_eq!((t.now(), t.exposed_s(), t.compute_s()), (4.0, 3.0, 1.0));
        // Waiting on a finished op costs nothing; a blocking op is all exposed.
        t.wait(a);
        t.blocking(0.5);
        assert_eq!((t.now(), t.exposed_s()), (4.5, 3.5));
    }

    #[test]
    fn noisy_ranks_hold_collectives_back_by_the_expected_maximum() {
        // Two ranks, 1 s of compute with σ = 0.1 s, then a blocking collective of 0.2 s: the
        // last rank issues it 0.5642 x 0.1 s late on average.
        let mut t = Timeline::new(2);
        t.compute_noisy(1.0, 0.01);
        t.blocking(0.2);
        assert!((t.now() - (1.0 + 0.05642 + 0.2)).abs() < 1e-12, "{t:?}");
        assert!((t.skew_s() - 0.05642).abs() < 1e-12);
        // The blocking wait lined the ranks up: the next collective is not held back.
        t.blocking(0.1);
        assert!((t.skew_s() - 0.05642).abs() < 1e-12);
        // An op hidden under compute lines nobody up: the drift goes on to the next wait.
        let mut t = Timeline::new(2);
        t.compute_noisy(0.5, 0.005);
        let hidden = t.issue(0.0);
        t.compute_noisy(0.5, 0.005);
        t.wait(hidden);
        assert_eq!(t.exposed_s(), 0.0);
        t.blocking(0.0);
        assert!((t.skew_s() - 0.05642).abs() < 1e-12, "{t:?}");
        // e_N grows with N (Blom's approximation continues the table).
        let e: Vec<f64> = [1, 2, 8, 9, 64, 1024]
            .iter()
            .map(|&n| expected_max_normal(n))
            .collect();
        assert!(e.windows(2).all(|w| w[1] > w[0]), "{e:?}");
        // Exact values (Harter's tables): n = 9, 100, 1000.
        for (n, e) in [(9, 1.4850), (100, 2.5076), (1000, 3.2414)] {
            assert!((expected_max_normal(n) - e).abs() < 0.01 * e, "{n}");
        }
        assert!((inverse_normal_cdf(0.975) - 1.959964).abs() < 1e-6);
        // With no core to spare the collective's work is taken from the compute stream.
        let mut t = Timeline::saturated(1);
        let op = t.issue(1.0);
        t.compute(3.0);
        t.wait(op);
        assert_eq!((t.now(), t.compute_s(), t.exposed_s()), (4.0, 4.0, 0.0));
        assert!((inverse_normal_cdf(0.001) + 3.090232).abs() < 1e-6);
    }
}
