//! Typed configuration of a process group, with the environment variables that override it.

use crate::algo::Algo;
use crate::error::{CommError, Result};
use crate::frame::OpKind;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Which transports a group may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportPolicy {
    /// Shared memory between ranks on one host, TCP between hosts.
    Auto,
    /// TCP for every pair (what Gloo does).
    TcpOnly,
}

/// Default spin before sleeping: longer than a typical peer round trip on shared memory (a few
/// microseconds), shorter than waking a halted vCPU (tens of microseconds on the reference VM).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

/// An automatic spin covers this many measured group rounds ([`crate::model::Topology::round`]):
/// a rank that starts to wait mid-step hears from its peer within about one round, and a spin
/// that ends just before the answer costs a sleep and a wake-up (on 2 netns hosts x 2 ranks,
/// rounds of 18-23 us: a 20 us spin left the 4 KiB ring and hierarchical times jumping between
/// about 90 and 130-180 us from run to run; 60 us kept them at 73-116 us in four runs of four).
pub const SPIN_ROUNDS: u32 = 3;

/// Longest automatic spin.
pub const MAX_SPIN: Duration = Duration::from_micros(100);

/// The automatic spin for a group whose measured round is `round` seconds: [`SPIN_ROUNDS`]
/// rounds, within [`DEFAULT_SPIN`]..=[`MAX_SPIN`].
pub fn auto_spin(round: f64) -> Duration {
    Duration::from_secs_f64((round * SPIN_ROUNDS as f64).max(0.0)).clamp(DEFAULT_SPIN, MAX_SPIN)
}

/// Configuration of a process group. `Default` plus [`GroupConfig::from_env`] is what a job gets.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// Timeout of every op unless the call gives its own. Env `FLOTILLA_TIMEOUT_S`.
    pub timeout: Duration,
    /// Timeout of group creation (rendezvous, connections, calibration).
    pub connect_timeout: Duration,
    /// Transports allowed. Env `FLOTILLA_TRANSPORT=auto|tcp`.
    pub transport: TransportPolicy,
    /// Bytes of each shared-memory ring (one per direction per local pair).
    pub shm_ring_bytes: usize,
    /// Directory of shared-memory segments. Env `FLOTILLA_SHM_DIR`.
    pub shm_dir: PathBuf,
    /// Host identity override (ranks with equal ids share memory). Env `FLOTILLA_HOST_ID`.
    pub host_id: Option<String>,
    /// Address other ranks reach this one at. Env `FLOTILLA_ADDR`; default: the local address
    /// of the route to the store.
    pub advertise_addr: Option<IpAddr>,
    /// Forced algorithm per op. Env `FLOTILLA_ALGO`, e.g. `ring` (every op it serves) or
    /// `all_reduce=tree,broadcast=ring`.
    pub algo: HashMap<OpKind, Algo>,
    /// Measure α and β per transport when the group is created. Env `FLOTILLA_CALIBRATE=0|1`.
    pub calibrate: bool,
    /// Ops kept by the flight recorder.
    pub flight_capacity: usize,
    /// Spin (yielding the CPU) this long before sleeping when an op waits; zero sleeps at once.
    /// Env `FLOTILLA_SPIN_US`. None: automatic, [`DEFAULT_SPIN`] until the group is calibrated,
    /// then [`auto_spin`] of its measured round.
    pub spin: Option<Duration>,
    /// Allow single-copy reads of local peers' memory (cross-memory attach) where the OS
    /// permits it. Env `FLOTILLA_DIRECT_READ=0|1`.
    pub direct_read: bool,
    /// How an op that no one forced picks its algorithm. Env `FLOTILLA_CHOOSE=measured|layout`.
    pub choose: Choice,
    /// How long a failed op waits for the other ranks' failure reports before naming the
    /// silent ones ([`super::core::DIAGNOSIS_GRACE`] by default; zero for groups whose members'
    /// deaths are told by other means, as the per-step fault tolerance's agents do).
    pub diagnosis_grace: Duration,
    /// Failures are expected and handled by the caller (per-step fault tolerance's groups):
    /// a failed op is logged at debug level, its flight recorder included, not as an error.
    pub quiet_failures: bool,
}

/// How a group picks each op's algorithm (when neither the call nor [`GroupConfig::algo`]
/// forces one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// The least predicted time under the group's calibration (what benchmarks want): the
    /// calibration is measured anew by every group, so two runs of one job may pick different
    /// algorithms, and with three or more ranks sum in different orders.
    Measured,
    /// The least predicted time under the group's layout alone: its size, hosts, link kinds and
    /// cores with the default link parameters, none of the calibration's timings. One layout
    /// always runs one algorithm per op and size, so a training run's sums, and with them its
    /// bits, repeat from run to run and across restarts (issue 27: "each gradient reduction's
    /// algorithm fixed by the layout").
    Layout,
}

impl GroupConfig {
    /// The spin an op uses now (see [`GroupConfig::spin`]).
    pub fn spin_now(&self) -> Duration {
        self.spin.unwrap_or(DEFAULT_SPIN)
    }
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(120),
            transport: TransportPolicy::Auto,
            shm_ring_bytes: 4 << 20,
            shm_dir: PathBuf::from("/dev/shm"),
            host_id: None,
            advertise_addr: None,
            algo: HashMap::new(),
            calibrate: true,
            flight_capacity: crate::flight::DEFAULT_CAPACITY,
            direct_read: true,
            spin: None,
            choose: Choice::Measured,
            diagnosis_grace: super::core::DIAGNOSIS_GRACE,
            quiet_failures: false,
        }
    }
}

impl GroupConfig {
    /// What a training job's groups get: the defaults choosing by [`Choice::Layout`], then
    /// the `FLOTILLA_*` environment variables.
    pub fn for_training() -> Result<GroupConfig> {
        let mut c = GroupConfig {
            choose: Choice::Layout,
            ..GroupConfig::default()
        };
        c.apply_env(|k| std::env::var(k).ok())?;
        Ok(c)
    }
}

impl GroupConfig {
    /// The defaults overridden by `FLOTILLA_*` environment variables.
    pub fn from_env() -> Result<GroupConfig> {
        let mut c = GroupConfig::default();
        c.apply_env(|k| std::env::var(k).ok())?;
        Ok(c)
    }

    /// Applies overrides from a variable lookup (testable without touching the environment).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<()> {
        if let Some(v) = get("FLOTILLA_TIMEOUT_S") {
            let s: f64 = v
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s > 0.0)
                .ok_or_else(|| {
                    CommError::Config(format!(
                        "FLOTILLA_TIMEOUT_S='{v}' is not a positive number of seconds"
                    ))
                })?;
            self.timeout = Duration::from_secs_f64(s);
        }
        if let Some(v) = get("FLOTILLA_TRANSPORT") {
            self.transport = match v.as_str() {
                "auto" | "shm" => TransportPolicy::Auto,
                "tcp" => TransportPolicy::TcpOnly,
                _ => {
                    return Err(CommError::Config(format!(
                        "FLOTILLA_TRANSPORT='{v}' (expected auto or tcp)"
                    )));
                }
            };
        }
        if let Some(v) = get("FLOTILLA_SHM_DIR") {
            self.shm_dir = PathBuf::from(v);
        }
        if let Some(v) = get("FLOTILLA_HOST_ID") {
            self.host_id = Some(v);
        }
        if let Some(v) = get("FLOTILLA_ADDR") {
            self.advertise_addr = Some(v.parse().map_err(|_| {
                CommError::Config(format!("FLOTILLA_ADDR='{v}' is not an IP address"))
            })?);
        }
        if let Some(v) = get("FLOTILLA_ALGO") {
            self.algo = parse_algo_overrides(&v)?;
        }
        if let Some(v) = get("FLOTILLA_CALIBRATE") {
            self.calibrate = !is_off(&v);
        }
        if let Some(v) = get("FLOTILLA_SPIN_US") {
            let us: u64 = v.parse().map_err(|_| {
                CommError::Config(format!(
                    "FLOTILLA_SPIN_US='{v}' is not a whole number of microseconds"
                ))
            })?;
            self.spin = Some(Duration::from_micros(us));
        }
        if let Some(v) = get("FLOTILLA_DIRECT_READ") {
            self.direct_read = !is_off(&v);
        }
        if let Some(v) = get("FLOTILLA_CHOOSE") {
            self.choose = match v.as_str() {
                "measured" => Choice::Measured,
                "layout" => Choice::Layout,
                _ => {
                    return Err(CommError::Config(format!(
                        "FLOTILLA_CHOOSE='{v}' (expected measured or layout)"
                    )));
                }
            };
        }
        Ok(())
    }
}

fn is_off(v: &str) -> bool {
    matches!(v, "0" | "false" | "no" | "off")
}

/// Parses `ring` or `all_reduce=tree,broadcast=ring` into forced algorithms per op.
pub fn parse_algo_overrides(v: &str) -> Result<HashMap<OpKind, Algo>> {
    let mut m = HashMap::new();
    for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            CommError::Config(format!(
                "FLOTILLA_ALGO entry '{part}': expected ALGO or OP=ALGO with ALGO one of {:?}",
                Algo::ALL.map(|a| a.name())
            ))
        };
        match part.split_once('=') {
            Some((op, algo)) => {
                let op = OpKind::ALL
                    .into_iter()
                    .find(|k| k.name() == op.trim())
                    .ok_or_else(bad)?;
                let algo = Algo::parse(algo.trim()).ok_or_else(bad)?;
                if !algo.serves(op) {
                    return Err(CommError::Config(format!(
                        "FLOTILLA_ALGO: {} does not implement {}",
                        algo.name(),
                        op.name()
                    )));
                }
                m.insert(op, algo);
            }
            None => {
                let algo = Algo::parse(part).ok_or_else(bad)?;
                for op in OpKind::ALL.into_iter().filter(|op| algo.serves(*op)) {
                    m.insert(op, algo);
                }
            }
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_automatic_spin_covers_three_rounds_within_bounds() {
        assert_eq!(auto_spin(4e-6), DEFAULT_SPIN);
        assert_eq!(auto_spin(20e-6), Duration::from_micros(60));
        assert_eq!(auto_spin(1e-3), MAX_SPIN);
        assert_eq!(auto_spin(f64::NAN), DEFAULT_SPIN);
        assert_eq!(GroupConfig::default().spin_now(), DEFAULT_SPIN);
    }

    #[test]
    fn env_overrides_and_errors_name_the_variable() {
        let mut c = GroupConfig::default();
        c.apply_env(|k| match k {
            "FLOTILLA_TIMEOUT_S" => Some("2.5".into()),
            "FLOTILLA_ALGO" => Some("all_reduce=tree, broadcast=ring".into()),
            "FLOTILLA_TRANSPORT" => Some("tcp".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.algo[&OpKind::AllReduce], Algo::Tree);
        assert_eq!(c.transport, TransportPolicy::TcpOnly);
        let e = GroupConfig::default()
            .apply_env(|k| (k == "FLOTILLA_TIMEOUT_S").then(|| "-1".into()))
            .unwrap_err();
        assert!(e.to_string().contains("FLOTILLA_TIMEOUT_S"));
        let e = parse_algo_overrides("all_to_all=ring").unwrap_err();
        assert!(e.to_string().contains("does not implement"), "{e}");
    }
}
