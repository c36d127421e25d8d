//! Units and conventions. Everything inside the planner is SI: bytes, seconds, bytes per second,
//! FLOP per second, watts. The seeds use decimal units almost everywhere (000 part 1 notes: "1 GB
//! = 10^9 B; 400 Gb/s = 50 GB/s"); file 004 uses binary units (GiB, MiB) in its examples 27.2 and
//! eq. 28.14. Both families are here so a test can state which one a seed used.
//!
//! Bandwidths are **unidirectional, per device** (000 Table 6.2 caption: "β is the unidirectional
//! rate; NVLink's 900 GB/s datasheet figure is bidirectional").

/// 10^3 bytes.
pub const KB: f64 = 1e3;
/// 10^6 bytes.
pub const MB: f64 = 1e6;
/// 10^9 bytes.
pub const GB: f64 = 1e9;
/// 10^12 bytes.
pub const TB: f64 = 1e12;
/// 2^10 bytes.
pub const KIB: f64 = 1024.0;
/// 2^20 bytes.
pub const MIB: f64 = 1_048_576.0;
/// 2^30 bytes.
pub const GIB: f64 = 1_073_741_824.0;
/// 2^40 bytes.
pub const TIB: f64 = 1_099_511_627_776.0;
/// One microsecond in seconds.
pub const US: f64 = 1e-6;
/// One millisecond in seconds.
pub const MS: f64 = 1e-3;
/// One hour in seconds.
pub const HOUR: f64 = 3600.0;
/// One day in seconds.
pub const DAY: f64 = 86_400.0;
/// 10^12 FLOP/s.
pub const TFLOPS: f64 = 1e12;

/// How the ring all-reduce bandwidth factor is taken: (p-1)/p exact or the seeds' large-p
/// limit 1 (defined with the shared collective formulas).
pub use ::cost::RingFactor;

/// Formats bytes with a decimal unit ("43.75 GB").
pub fn fmt_bytes(b: f64) -> String {
    let (v, u) = if b >= TB {
        (b / TB, "TB")
    } else if b >= GB {
        (b / GB, "GB")
    } else if b >= MB {
        (b / MB, "MB")
    } else if b >= KB {
        (b / KB, "KB")
    } else {
        (b, "B")
    };
    format!("{v:.2} {u}")
}

/// Formats seconds with a fitting unit ("12.3 ms").
pub fn fmt_time(s: f64) -> String {
    if s >= DAY {
        format!("{:.2} d", s / DAY)
    } else if s >= HOUR {
        format!("{:.2} h", s / HOUR)
    } else if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= MS {
        format!("{:.3} ms", s / MS)
    } else {
        format!("{:.3} us", s / US)
    }
}
