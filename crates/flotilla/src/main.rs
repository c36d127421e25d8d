//! `flotilla`: one binary for training, planning, benchmarking and inspecting jobs.

mod bench_check;
mod bench_comm;
mod spawn;

use clap::{Parser, Subcommand};

/// Flotilla: distributed deep-learning training that never hangs silently.
#[derive(Parser)]
#[command(name = "flotilla", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmarks (collectives).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Collective bandwidth and latency in the manner of nccl-tests.
    Comm(bench_comm::Args),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FLOTILLA_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench {
            what: BenchCommand::Comm(a),
        } => bench_comm::run(a),
    };
    if let Err(e) = result {
        eprintln!("flotilla: error: {e:#}");
        std::process::exit(1);
    }
}
