//! Checkpoint and resume through flotilla-ckpt: a resumed run continues bit-identically (sync
//! and async saves, f32 and bf16, built-in corpus and token datasets), a corrupt newest step
//! falls back to the previous one, and a checkpoint of another config is refused.
use std::path::Path;

use ckpt::{Checkpoint, Verify};
use model::config::ModelConfig;
use train::{CheckpointConfig, Checkpointer, DataSpec, TrainConfig, TrainError, Trainer};

fn tiny(steps: u64) -> TrainConfig {
    let mut c = TrainConfig::new(ModelConfig::gpt2(2, 4, 64, 32, 64), steps);
    c.batch = 4;
    c.lr = 3e-3;
    c.threads = 2;
    c.seed = 11;
    c.data = DataSpec::Markov { branching: 4 };
    c
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn checkpointer(dir: &Path, every: u64, asynchronous: bool) -> Checkpointer {
    let cfg = CheckpointConfig {
        dir: dir.to_path_buf(),
        every,
        asynchronous,
        auto_mtbf: None,
    };
    Checkpointer::new(cfg, "test-run").unwrap()
}

/// Trains `cfg` straight through, and again in two halves with a save, a fresh process-like
/// trainer and a resume in between (one eval batch drawn before the save, so the data cursor
/// counts more than steps); the final parameters and moments must match bit for bit.
fn assert_resume_bit_identical(cfg: TrainConfig, asynchronous: bool) {
    let steps = cfg.steps;
    let mut straight = Trainer::new(cfg.clone()).unwrap();
    for i in 0..steps {
        if i == steps / 2 {
            straight.eval_loss(1).unwrap();
        }
        straight.step().unwrap();
    }

    let dir = tempfile::tempdir().unwrap();
    let mut first = Trainer::new(cfg.clone()).unwrap();
    let mut ck = checkpointer(dir.path(), 2, asynchronous);
    for _ in 0..steps / 2 {
        ck.step(&mut first).unwrap();
    }
    first.eval_loss(1).unwrap();
    ck.finish(&mut first).unwrap();
    drop(first);

    let mut resumed = Trainer::new(cfg).unwrap();
    let (step, rejected) = Checkpointer::resume(dir.path(), &mut resumed)
        .unwrap()
        .unwrap();
    assert_eq!((step, rejected.len()), (steps / 2, 0));
    assert_eq!(resumed.steps_done(), steps / 2);
    for _ in steps / 2..steps {
        resumed.step().unwrap();
    }
    assert_eq!(bits(resumed.params()), bits(straight.params()));
    assert_eq!(
        bits(resumed.master_params()),
        bits(straight.master_params())
    );
    let (a, b) = (
        resumed.optimizer().moments(),
        straight.optimizer().moments(),
    );
    assert_eq!((bits(a.0), bits(a.1)), (bits(b.0), bits(b.1)));
    assert_eq!(
        resumed.optimizer().step_count(),
        straight.optimizer().step_count()
    );
}

#[test]
fn resume_is_bit_identical_sync() {
    assert_resume_bit_identical(tiny(6), false);
}

#[test]
fn resume_is_bit_identical_async_bf16() {
    let mut cfg = tiny(6);
    cfg.bf16 = true;
    assert_resume_bit_identical(cfg, true);
}

#[test]
fn resume_is_bit_identical_on_token_datasets() {
    let data_dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny(6);
    let synth = data::synth::SynthConfig {
        tokens: 20_000,
        vocab: 64,
        branching: 4,
        doc_tokens: 500,
        shard_bytes: 16_000,
        seed: 5,
    };
    data::synth::write_synthetic(data_dir.path(), &synth, |_| {}).unwrap();
    cfg.data = DataSpec::Dataset {
        dirs: vec![data_dir.path().to_path_buf()],
        loader: data::LoaderConfig::new(cfg.seq_len, cfg.batch as u64, cfg.seed),
    };
    assert_resume_bit_identical(cfg, true);
}

#[test]
fn checkpoint_holds_every_tensor_and_the_run_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(tiny(3)).unwrap();
    let mut ck = checkpointer(dir.path(), 0, false);
    for _ in 0..3 {
        assert!(ck.step(&mut t).unwrap().1.is_none(), "every 0: end only");
    }
    let saved = ck.finish(&mut t).unwrap().unwrap();
    assert_eq!(saved.step, 3);
    assert_eq!(saved.bytes, 3 * 4 * t.params().len() as u64);
    let c = Checkpoint::open(dir.path(), 3, Verify::AllPieces).unwrap();
    let layout = t.model().layout();
    assert_eq!(c.manifest().tensors.len(), 3 * layout.entries.len());
    let wte = c.read_tensor("model.wte").unwrap();
    let want = &t.params()[layout.get("wte").unwrap().range()];
    assert_eq!(wte, ckpt::f32_bytes(want));
    assert_eq!(c.state()["step"], 3);
    assert_eq!(c.state()["optimizer_step"], 3);
    assert_eq!(c.state()["batches_drawn"], 3);
    assert_eq!(c.state()["model_config"]["flotilla.layers"], "2");
}

#[test]
fn a_corrupt_newest_step_falls_back_to_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(tiny(4)).unwrap();
    let mut ck = checkpointer(dir.path(), 2, false);
    for _ in 0..4 {
        ck.step(&mut t).unwrap();
    }
    let file = dir.path().join("step-4").join(ckpt::rank_file_name(0));
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let mut resumed = Trainer::new(tiny(4)).unwrap();
    let (step, rejected) = Checkpointer::resume(dir.path(), &mut resumed)
        .unwrap()
        .unwrap();
    assert_eq!(step, 2);
    assert_eq!(rejected.len(), 1);
    assert!(
        rejected[0].contains("step 4") && rejected[0].contains("rank-00000"),
        "{rejected:?}"
    );
    assert_eq!(resumed.steps_done(), 2);
}

#[test]
fn another_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(tiny(2)).unwrap();
    let mut ck = checkpointer(dir.path(), 0, false);
    t.step().unwrap();
    ck.finish(&mut t).unwrap();
    let mut other = tiny(2);
    other.lr = 1e-3;
    let mut t2 = Trainer::new(other).unwrap();
    let err = Checkpointer::resume(dir.path(), &mut t2).unwrap_err();
    assert!(matches!(err, TrainError::Resume { step: 1, .. }), "{err}");
    // More steps and another thread count are allowed.
    let mut more = tiny(10);
    more.threads = 1;
    let mut t3 = Trainer::new(more).unwrap();
    let resumed = Checkpointer::resume(dir.path(), &mut t3).unwrap().unwrap();
    assert_eq!(resumed.0, 1);
}

#[test]
fn automatic_interval_follows_young_daly() {
    // A job that fails every femtosecond is due for a checkpoint after every step; one that
    // fails every 30 years only saves at the end.
    for (mtbf, saves) in [(1e-15, 4usize), (1e9, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CheckpointConfig {
            dir: dir.path().to_path_buf(),
            every: 0,
            asynchronous: true,
            auto_mtbf: Some(mtbf),
        };
        let mut ck = Checkpointer::new(cfg, "auto").unwrap();
        let mut t = Trainer::new(tiny(4)).unwrap();
        let mut planned = Vec::new();
        for _ in 0..4 {
            if let Some(s) = ck.step(&mut t).unwrap().1 {
                planned.push(s.planned.unwrap());
            }
        }
        if let Some(s) = ck.finish(&mut t).unwrap() {
            planned.push(s.planned.unwrap());
        }
        assert_eq!(
            ckpt::list_committed(dir.path()).unwrap().len(),
            saves,
            "mtbf {mtbf}"
        );
        for (tau, loss) in planned {
            assert!(tau > 0.0 && tau.is_finite() && loss > 0.0, "{tau} {loss}");
        }
    }
    let bad = CheckpointConfig {
        dir: tempfile::tempdir().unwrap().path().to_path_buf(),
        every: 0,
        asynchronous: false,
        auto_mtbf: Some(-1.0),
    };
    let err = Checkpointer::new(bad, "auto").err().unwrap();
    assert!(err.to_string().contains("-1"), "{err}");
}

#[test]
fn async_saves_stage_during_the_next_step_and_match_sync_saves() {
    // Every step saved, asynchronously (each staged during the step after it, the last by
    // finish) and synchronously: the same steps are committed with the same tensor bytes.
    let mut committed = Vec::new();
    for asynchronous in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Trainer::new(tiny(3)).unwrap();
        let mut ck = checkpointer(dir.path(), 1, asynchronous);
        let mut summaries = Vec::new();
        for _ in 0..3 {
            let (stats, saved) = ck.step(&mut t).unwrap();
            if let Some(s) = saved {
                // An async save of step k is staged while step k + 1 runs.
                let lag = u64::from(asynchronous);
                assert_eq!(s.step + lag, stats.step);
                summaries.push(s.step);
            }
        }
        if let Some(s) = ck.finish(&mut t).unwrap() {
            summaries.push(s.step);
        }
        assert_eq!(summaries, vec![1, 2, 3]);
        let steps = ckpt::list_committed(dir.path()).unwrap();
        let tensors: Vec<Vec<u8>> = steps
            .iter()
            .map(|&s| {
                let c = Checkpoint::open(dir.path(), s, Verify::AllPieces).unwrap();
                c.read_tensor("optim.exp_avg_sq.h.0.mlp.fc.weight").unwrap()
            })
            .collect();
        committed.push((steps, tensors, dir));
    }
    assert_eq!(committed[0].0, vec![1, 2, 3]);
    assert_eq!(committed[0].0, committed[1].0);
    assert!(
        committed[0].1 == committed[1].1,
        "async and sync checkpoints differ"
    );
}
