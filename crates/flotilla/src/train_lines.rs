//! The lines `flotilla train` prints beside its progress bar: the state memory of a rank
//! against its ZeRO formula, and the communication shares of a step.

use indicatif::ProgressBar;
use train::Trainer;

/// The state-memory line of a data-parallel run: what this rank holds, measured, beside the
/// formula of its ZeRO stage (`train::zero::expected_bytes`).
pub(crate) fn state_line(trainer: &Trainer) -> String {
    let m = trainer.state_memory();
    let stage = trainer.zero_stage();
    let (p, g, o) = train::zero::expected_bytes(stage, trainer.world());
    let n = trainer.model().n_params() as f64;
    format!(
        "# state per rank ({}): parameters {:.1} MB, gradients {:.1} MB, optimizer {:.1} MB \
         (formula {p:.2} + {g:.2} + {o:.2} bytes/param: {:.1} + {:.1} + {:.1} MB){}",
        stage.map_or("data parallel".to_string(), |s| format!(
            "ZeRO-{}",
            s.number()
        )),
        m.params as f64 / 1e6,
        m.grads as f64 / 1e6,
        m.optimizer as f64 / 1e6,
        p * n / 1e6,
        g * n / 1e6,
        o * n / 1e6,
        match m.comm_buffers {
            0 => String::new(),
            b => {
                let kind = if stage.is_some() {
                    "transfer"
                } else {
                    "bucket"
                };
                format!("; {kind} buffers {:.1} MB", b as f64 / 1e6)
            }
        }
    )
}

/// Prints a line above the progress bar (or plainly when it is hidden).
pub(crate) fn say(pb: &ProgressBar, line: String) {
    if pb.is_hidden() {
        println!("{line}")
    } else {
        pb.println(line)
    }
}

/// The exposed-communication part of a line, for data-parallel runs.
pub(crate) fn comm_note(comm_s: f64, step_s: f64, world: usize) -> String {
    if world == 1 {
        return String::new();
    }
    format!(
        " comm {:.1}% ({world} ranks)",
        100.0 * comm_s / step_s.max(1e-9)
    )
}

/// The summary's split of the lead rank's waits (`train::peer_wait`): what communication the
/// schedule left exposed, and what was waiting for slower ranks.
pub(crate) fn split_note(split: Option<train::peer_wait::WaitSplit>, step_s: f64) -> String {
    let Some(s) = split else {
        return String::new();
    };
    let pct = |x: f64| 100.0 * x / step_s.max(1e-9);
    format!(
        ": exposed {:.1}% after the slowest rank's compute, {:.1}% waiting for slower ranks",
        pct(s.exposed_s),
        pct(s.peer_wait_s)
    )
}
