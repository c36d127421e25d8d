//! Range-checked parsers of the numeric flags of every subcommand, used as clap
//! `value_parser`s: nonsense (`0` where a count must be positive, `NaN`, `inf`, a negative
//! rate, a process count that would fork until the OS refuses) is refused while the command
//! line is parsed, before any file is created or process started. clap's error names the flag
//! (`invalid value 'NaN' for '--rate <RATE>'`) and exits with its usage code 2; the messages
//! here name the allowed range.

use clap::builder::RangedU64ValueParser;

/// Most worker processes one node may start (`--nproc`): 1024. A fixed bound rather than one
/// derived from this machine's cores, because running more workers than cores is legitimate
/// (the tests run 4 workers on 2 cores) and the launching host need not be the one the
/// workers' load was sized for. 1024 is above any real node (8 to 16 accelerators, a few
/// hundred hardware threads) and far below the usual per-user process limit (`ulimit -u`, tens
/// of thousands), so a typo such as `--nproc 100000` is refused by name before the first fork
/// instead of forking until the OS stops it.
pub const MAX_NPROC: u64 = 1024;

/// Largest tensor-parallel or pipeline degree (`--tp`, `--pp`): 65536, more ranks than one
/// model is split over in any job, small enough that `tp x pp` cannot overflow.
pub const MAX_DEGREE: u64 = 1 << 16;

/// Most threads one pool may start (`--threads`, the loader's `--workers`): 1024, for the
/// reasons of [`MAX_NPROC`] (oversubscription is legitimate; a thread per hardware thread of
/// the largest hosts fits; `--threads 100000` is refused before it spawns).
pub const MAX_THREADS: u64 = 1024;

/// A whole count in `lo..=hi`, as a `usize` (`--nproc`, `--threads`, degrees, sizes).
pub fn usize_in(lo: u64, hi: u64) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(lo..=hi)
}

/// A whole count of at least one, as a `usize` (`--batch`, `--layers`, ...).
pub fn positive_usize() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

/// A whole count of at least one, as a `u64` (`--log-every`, `--job-timeout-s`, ...).
pub fn positive_u64() -> RangedU64ValueParser<u64> {
    RangedU64ValueParser::new().range(1..)
}

/// A finite number satisfying `ok`, else a message saying it must lie in `range`.
fn finite(s: &str, ok: impl Fn(f64) -> bool, range: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !(v.is_finite() && ok(v)) {
        return Err(format!("{v} is outside {range}"));
    }
    Ok(v)
}

/// A number in `lo..=hi` (`lo` excluded when `open`), else a message naming the range.
pub fn number_in(s: &str, lo: f64, hi: f64, open: bool) -> Result<f64, String> {
    let low = if open { "(" } else { "[" };
    finite(
        s,
        |v| (if open { v > lo } else { v >= lo }) && v <= hi,
        &format!("{low}{lo}, {hi}]"),
    )
}

/// A finite number above zero (`--peak-gflops`, `--duration`, `--epochs`, ...).
pub fn positive_f64(s: &str) -> Result<f64, String> {
    finite(s, |v| v > 0.0, "(0, inf): a finite number above zero")
}

/// A finite number, zero or more (`data stress --rate`, where 0 means unpaced; `generate
/// --temperature`, where 0 means greedy).
pub fn finite_nonneg_f64(s: &str) -> Result<f64, String> {
    finite(s, |v| v >= 0.0, "[0, inf): a finite number, zero or more")
}

/// A duration in seconds for a timeout: in (0, 1e9] (about 31 years; a larger one would
/// overflow the deadline arithmetic, and a timeout of zero fails at once).
pub fn seconds(s: &str) -> Result<f64, String> {
    number_in(s, 0.0, 1e9, true)
}

/// A fraction in [0, 1] (`--min-lr-ratio`).
pub fn unit_interval(s: &str) -> Result<f64, String> {
    finite(s, |v| (0.0..=1.0).contains(&v), "[0, 1]")
}

/// A fraction in [0, 1) (`data bench --resume-at`).
pub fn fraction_below_one(s: &str) -> Result<f64, String> {
    finite(s, |v| (0.0..1.0).contains(&v), "[0, 1)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::builder::TypedValueParser;

    #[test]
    fn floats_refuse_nonsense_naming_the_range() {
        assert_eq!(positive_f64("2.5"), Ok(2.5));
        for bad in ["0", "-1", "NaN", "inf", "-inf", "x", ""] {
            let e = positive_f64(bad).unwrap_err();
            assert!(
                e.contains("(0, inf)") || e.contains("not a number"),
                "{bad}: {e}"
            );
        }
        assert_eq!(finite_nonneg_f64("0"), Ok(0.0));
        assert!(finite_nonneg_f64("-0.5").unwrap_err().contains("[0, inf)"));
        assert!(finite_nonneg_f64("NaN").is_err() && finite_nonneg_f64("inf").is_err());
        assert_eq!(number_in("64", 0.0, 64.0, true), Ok(64.0));
        assert!(
            number_in("0", 0.0, 64.0, true)
                .unwrap_err()
                .contains("(0, 64]")
        );
        assert_eq!(number_in("0", 0.0, 10.0, false), Ok(0.0));
        assert!(seconds("0").is_err() && seconds("1e10").is_err() && seconds("30") == Ok(30.0));
        assert!(fraction_below_one("1").is_err() && fraction_below_one("0.5") == Ok(0.5));
    }

    #[test]
    fn counts_refuse_zero_and_the_unbounded() {
        let cmd = clap::Command::new("t");
        let nproc = usize_in(1, MAX_NPROC);
        let parse = |p: &RangedU64ValueParser<usize>, s: &str| {
            p.parse_ref(&cmd, None, std::ffi::OsStr::new(s))
        };
        assert_eq!(parse(&nproc, "8").unwrap(), 8);
        for bad in ["0", "100000", "-1", "NaN"] {
            assert!(parse(&nproc, bad).is_err(), "{bad}");
        }
        assert!(parse(&positive_usize(), "0").is_err());
        assert_eq!(parse(&positive_usize(), "3").unwrap(), 3);
    }
}
