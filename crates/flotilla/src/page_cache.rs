//! Emptying the kernel's page cache, for benchmarks that measure cold reads (`--cold`).

use anyhow::Result;

/// Writes dirty pages back and empties the page cache, so the next read comes from the disk.
/// Needs root (it writes `/proc/sys/vm/drop_caches`); the error says so.
pub fn drop_caches() -> Result<()> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").map_err(|e| {
        anyhow::anyhow!("--cold: cannot write /proc/sys/vm/drop_caches ({e}); it needs root")
    })
}
