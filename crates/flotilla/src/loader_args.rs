//! Command-line options that build a data loader (shared by `train`, `data stress`, `data bench`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::flag_range::{
    MAX_THREADS, positive_f64, positive_u64, positive_usize, seconds, usize_in,
};
use data::{Dataset, LoaderConfig, Prefetch};

/// Which datasets to read and how to cut, shuffle and deliver them.
#[derive(clap::Args, Clone, Debug)]
pub struct LoaderArgs {
    /// Dataset directories (made by `flotilla data prepare` or `data synth`), or
    /// s3://bucket/prefix (streamed through --data-cache; `s3` feature); several make a
    /// weighted mixture.
    #[arg(long = "dataset", value_name = "DIR")]
    pub datasets: Vec<PathBuf>,
    /// Mixture weights, one per --dataset, comma-separated (default: equal).
    #[arg(long, value_delimiter = ',', value_parser = positive_f64)]
    pub weights: Vec<f64>,
    /// Reader threads.
    #[arg(long, default_value_t = 2, value_parser = usize_in(1, MAX_THREADS))]
    pub workers: usize,
    /// Prefetch depth in batches, or `auto` (from P99 batch latency and step time, eq. 4.3).
    #[arg(long, default_value = "auto")]
    pub prefetch: String,
    /// Shuffle window in sequences (the bounded within-shard shuffle buffer).
    #[arg(long, default_value_t = 1 << 16, value_parser = positive_u64())]
    pub shuffle_window: u64,
    /// Data-parallel world size this loader is one rank of.
    #[arg(long, default_value_t = 1, value_parser = positive_u64())]
    pub world: u64,
    /// This loader's rank.
    #[arg(long, default_value_t = 0)]
    pub rank: u64,
    /// Seconds `next` waits for a batch before failing.
    #[arg(long, default_value_t = 120.0, value_parser = seconds)]
    pub data_timeout: f64,
    /// Local cache of s3:// datasets (default: $TMPDIR/flotilla-data-cache).
    #[arg(long, value_name = "DIR")]
    pub data_cache: Option<PathBuf>,
    /// Most GiB of shards the cache keeps per dataset (least recently used let go first).
    #[arg(long, default_value_t = 16.0, value_parser = positive_f64)]
    pub data_cache_gb: f64,
    /// Never hedge a slow ranged read of an s3:// dataset (default: after the P95 latency).
    #[arg(long)]
    pub no_hedge: bool,
}

/// A loader run outside training (`data stress`, `data bench`): the loader options plus the
/// sequence shape and seed that training would otherwise supply.
#[derive(clap::Args, Clone, Debug)]
pub struct LoaderRunArgs {
    #[command(flatten)]
    pub loader: LoaderArgs,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024, value_parser = positive_usize())]
    pub seq_len: usize,
    /// Sequences per global batch.
    #[arg(long, default_value_t = 8, value_parser = positive_u64())]
    pub global_batch: u64,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl LoaderRunArgs {
    /// The loader config for these options.
    pub fn config(&self) -> Result<LoaderConfig> {
        self.loader
            .config(self.seq_len, self.global_batch, self.seed)
    }
}

impl LoaderArgs {
    /// Whether any dataset was given.
    pub fn given(&self) -> bool {
        !self.datasets.is_empty()
    }

    /// Opens the datasets (manifest read, every shard stat-ed).
    pub fn open(&self) -> Result<Vec<Arc<Dataset>>> {
        if self.datasets.is_empty() {
            bail!("no --dataset given");
        }
        self.datasets
            .iter()
            .map(|d| {
                data::cache::open(d, &self.cache())
                    .map(Arc::new)
                    .with_context(|| format!("opening dataset {}", d.display()))
            })
            .collect()
    }

    /// Where s3:// datasets are cached.
    pub fn cache(&self) -> data::CacheConfig {
        let max_bytes = (self.data_cache_gb * f64::from(1u32 << 30)) as u64;
        let (dir, hedge) = (self.data_cache.clone(), !self.no_hedge);
        data::CacheConfig {
            dir,
            max_bytes,
            hedge,
        }
    }

    /// The loader config for sequences of `seq_len` tokens, `global_batch` per step.
    pub fn config(&self, seq_len: usize, global_batch: u64, seed: u64) -> Result<LoaderConfig> {
        let mut c = LoaderConfig::new(seq_len, global_batch, seed);
        c.world = self.world;
        c.rank = self.rank;
        c.workers = self.workers;
        c.shuffle_window = self.shuffle_window;
        c.cache = self.cache();
        c.prefetch = match self.prefetch.as_str() {
            "auto" => Prefetch::Auto { max: 64 },
            n => Prefetch::Fixed(
                n.parse()
                    .with_context(|| format!("--prefetch {n}: expected a number or auto"))?,
            ),
        };
        c.weights = match self.weights.len() {
            0 => vec![1.0; self.datasets.len().max(1)],
            n if n == self.datasets.len() => self.weights.clone(),
            n => bail!(
                "--weights has {n} values for {} datasets: give one per --dataset",
                self.datasets.len()
            ),
        };
        c.timeout = Duration::from_secs_f64(self.data_timeout);
        check_memory(&c)?;
        Ok(c)
    }
}

/// Refuses a loader whose batches in flight cannot fit in this machine's memory: up to the
/// prefetch depth of filed batches, one being built per reader and the consumer's, each of
/// `global_batch / world` rows of `seq_len + 1` token ids (4 bytes at most).
fn check_memory(c: &LoaderConfig) -> Result<()> {
    let depth = match c.prefetch {
        Prefetch::Fixed(n) => n,
        Prefetch::Auto { max } => max,
    };
    let batches = (depth as u64).saturating_add(c.workers as u64 + 1);
    let rows = c.global_batch / c.world.max(1);
    let batch_bytes = rows.saturating_mul(c.seq_len as u64 + 1).saturating_mul(4);
    Ok(model::memory::check_fits(
        &format!(
            "{batches} batches in flight of {rows} rows x {} tokens",
            c.seq_len + 1
        ),
        batches.saturating_mul(batch_bytes),
        model::memory::available_bytes(),
        "lower the global batch, the sequence length or --prefetch",
    )?)
}
