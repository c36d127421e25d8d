//! `flotilla`: one binary for training, planning, benchmarking and inspecting jobs.

mod bench_comm;
mod bench_model;
mod ckpt_bench_cmd;
mod ckpt_cmd;
mod ckpt_convert_cmd;
mod ckpt_policy_cmd;
mod config_file;
mod data_bench_cmd;
mod data_cmd;
mod data_inspect_cmd;
mod data_prepare_cmd;
mod data_stress_cmd;
mod data_synth_cmd;
mod data_verify_cmd;
mod flag_range;
mod generate_cmd;
mod loader_args;
mod model_args;
mod moe_args;
mod plan_cmd;
mod report_cmd;
mod spawn;
mod train_cmd;
mod train_ft;

use clap::{CommandFactory, Parser, Subcommand};

/// Flotilla: distributed deep-learning training that never hangs silently.
#[derive(Parser)]
#[command(name = "flotilla", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Train a model in this process (step, loss, tokens/s, MFU).
    Train(train_cmd::Args),
    /// Sample text from a model saved by `flotilla train --save`.
    Generate(generate_cmd::Args),
    /// Datasets: prepare (tokenize into shards), inspect, verify, synth, stress, bench.
    Data {
        #[command(subcommand)]
        what: data_cmd::DataCommand,
    },
    /// Checkpoints: ls, show, verify, convert (Hugging Face, offline reshard), gc (retention),
    /// interval (Young/Daly), bench.
    Ckpt {
        #[command(subcommand)]
        what: ckpt_cmd::CkptCommand,
    },
    /// Plan a job before running it: memory, step time, layout search, cost, checkpoint
    /// interval (docs/PLAN.md).
    Plan(plan_cmd::Args),
    /// Plots of a run's metrics file: loss and validation loss, tokens/s, the step time
    /// breakdown (PNG and SVG; docs/OBSERVE.md).
    Report(report_cmd::Args),
    /// Benchmarks (collectives, model training throughput).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)]
enum BenchCommand {
    /// Collective bandwidth and latency in the manner of nccl-tests.
    Comm(bench_comm::Args),
    /// Training tokens/s and MFU in the peer benchmark's format, and GEMM GFLOP/s.
    Model(bench_model::Args),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLOTILLA_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // `--config FILE.toml` becomes the file's options, ahead of the command line's.
    let args = match config_file::expand(&Cli::command(), std::env::args_os()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("flotilla: error: {}", error_chain(&e));
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(args);
    if cli.command.talks_to_peers() {
        // Rust ignores SIGPIPE: a write to a closed socket is an EPIPE error the comm and
        // launch code report (naming the peer), which a signal would turn into a silent death.
    } else {
        restore_default_sigpipe();
    }
    let result = match cli.command {
        Command::Bench {
            what: BenchCommand::Comm(a),
        } => bench_comm::run(a),
        Command::Bench {
            what: BenchCommand::Model(a),
        } => bench_model::run(a),
        Command::Data { what } => data_cmd::run(what),
        Command::Ckpt { what } => ckpt_cmd::run(what),
        Command::Train(a) => train_cmd::run(a),
        Command::Plan(a) => plan_cmd::run(a),
        Command::Report(a) => report_cmd::run(a),
        Command::Generate(a) => generate_cmd::run(a),
    };
    if let Err(e) = result {
        // The exit-code table (launch::exit): the agent and schedulers act on these.
        let exit = launch::Exit::of_error(e.chain(), is_refusal);
        let what = if exit == launch::Exit::Preempted {
            ""
        } else {
            "error: "
        };
        // One write: a job's workers share the launcher's stderr.
        let line = format!("flotilla: {what}{}\n", error_chain(&e));
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        std::process::exit(exit.code());
    }
}

impl Command {
    /// Whether the command exchanges data with other processes over sockets (`train`, `bench
    /// comm`, `plan --calibrate`): those keep Rust's ignored SIGPIPE.
    fn talks_to_peers(&self) -> bool {
        match self {
            Command::Train(_) => true,
            Command::Bench { what } => matches!(what, BenchCommand::Comm(_)),
            Command::Plan(a) => a.calibrate,
            Command::Generate(_) | Command::Data { .. } | Command::Ckpt { .. } => false,
            Command::Report(_) => false,
        }
    }
}

/// Restores the default action of SIGPIPE (end the process quietly), as other Unix tools have
/// it: `flotilla ckpt ls DIR | head -c1` then stops at its next write once `head` has gone,
/// instead of `println!` panicking on the broken pipe (Rust's runtime ignores SIGPIPE, so the
/// write returns EPIPE and `println!` panics on it).
fn restore_default_sigpipe() {
    // SAFETY: `signal` with SIG_DFL installs no handler (no code runs in signal context); it
    // is called once, from the main thread, before this process starts any thread that could
    // race on the disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Whether the cause `c` is a refusal a restart would only meet again: a configuration the run refuses
/// ([`train::TrainError::is_refusal`]), or the model's refusal of a config too large for this
/// machine's memory.
fn is_refusal(c: &(dyn std::error::Error + 'static)) -> bool {
    matches!(c.downcast_ref(), Some(model::ModelError::Memory { .. }))
        || c.downcast_ref::<train::TrainError>()
            .is_some_and(train::TrainError::is_refusal)
}

/// An error and its causes, joined by ": " as anyhow's `{:#}` does, leaving out a cause whose
/// text the message before it already ends with (the crates' error enums print their I/O source
/// in their own message too, so `{:#}` said "No such file or directory" twice).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own consistency checks over every subcommand (unique names, valid defaults):
    /// a clash otherwise shows only when that subcommand is first parsed.
    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn error_chain_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let inner = anyhow::Error::new(io).context("/d/manifest.json: no such file");
        let e = inner.context("opening dataset /d");
        assert_eq!(
            error_chain(&e),
            "opening dataset /d: /d/manifest.json: no such file"
        );
        let plain = anyhow::anyhow!("root cause").context("outer");
        assert_eq!(error_chain(&plain), "outer: root cause");
    }
}
