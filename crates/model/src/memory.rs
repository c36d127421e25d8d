//! Up-front memory checks: a config whose buffers cannot fit is refused with an error that
//! names what needs how much, before anything is allocated (an allocation the kernel refuses
//! aborts the process; one it overcommits is killed later, when first touched). The model's
//! activations and the trainer's state are checked here; the CLI checks a loader's batches in
//! flight and `bench comm`'s buffers with the same functions.
use crate::error::{ModelError, Result};

/// Bytes this machine can still give this process without swapping: `MemAvailable` of
/// `/proc/meminfo`, shared equally among the node's workers when a launcher says how many there
/// are (`LOCAL_WORLD_SIZE`, torchrun's name, which Flotilla's agent sets too); None where
/// `/proc/meminfo` cannot be read (e.g. off Linux).
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let local = std::env::var("LOCAL_WORLD_SIZE").ok();
    Some(parse_mem_available(&text)? / local_workers(local.as_deref()))
}

/// The node's worker count from `LOCAL_WORLD_SIZE` (1 when absent or not a positive number).
fn local_workers(value: Option<&str>) -> u64 {
    value
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// The `MemAvailable:` line of a `/proc/meminfo` text, in bytes.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses `need` bytes for `what` when they exceed `available` (when that is known), with
/// `hint` saying which settings lower the need.
pub fn check_fits(what: &str, need: u64, available: Option<u64>, hint: &str) -> Result<()> {
    match available {
        Some(avail) if need > avail => Err(ModelError::Memory {
            what: what.to_string(),
            need,
            available: avail,
            hint: hint.to_string(),
        }),
        _ => Ok(()),
    }
}

/// `count` elements of `T` times `size_of::<T>()`, saturating (a count from a config cannot
/// overflow into a small number).
pub fn bytes_of<T>(count: usize) -> u64 {
    (count as u64).saturating_mul(std::mem::size_of::<T>() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(23_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn the_node_memory_is_shared_among_its_workers() {
        assert_eq!(local_workers(None), 1);
        assert_eq!(local_workers(Some("4")), 4);
        assert_eq!(local_workers(Some("0")), 1);
        assert_eq!(local_workers(Some("many")), 1);
    }

    #[test]
    fn a_need_above_what_is_available_is_refused_by_name() {
        assert!(check_fits("x", 10, Some(10), "h").is_ok());
        assert!(check_fits("x", 10, None, "h").is_ok());
        let e = check_fits("activations", 11, Some(10), "lower the batch").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("activations") && msg.contains("lower the batch"),
            "{msg}"
        );
        assert!(matches!(
            e,
            ModelError::Memory {
                need: 11,
                available: 10,
                ..
            }
        ));
    }

    #[test]
    fn byte_counts_saturate() {
        assert_eq!(bytes_of::<f32>(3), 12);
        assert_eq!(bytes_of::<f64>(usize::MAX), u64::MAX);
    }
}
