//! The trainer end to end: a tiny model learns the built-in corpus, runs
//! are bit-reproducible, and bad settings or a diverging run are errors
//! naming the field or the step.
use model::config::ModelConfig;
use train::{DataSpec, TrainConfig, TrainError, Trainer};

fn tiny(steps: u64) -> TrainConfig {
    let mut c = TrainConfig::new(ModelConfig::gpt2(2, 4, 64, 32, 64), steps);
    c.batch = 8;
    c.lr = 3e-3;
    c.threads = 2;
    c.seed = 7;
    c.data = DataSpec::Markov { branching: 4 };
    c
}

fn losses(cfg: TrainConfig) -> (Vec<f64>, f64) {
    let mut t = Trainer::new(cfg).unwrap();
    let floor = t.entropy_floor().unwrap();
    let steps = t.config().steps;
    ((0..steps).map(|_| t.step().unwrap().loss).collect(), floor)
}

/// The stated result: from ln(64) = 4.16 nats, 150 steps of batch 8 x 32
/// bring the loss below 2.0 (the corpus' entropy rate is about 1.2).
#[test]
fn tiny_model_learns_the_builtin_corpus_and_runs_are_bit_identical() {
    let (a, floor) = losses(tiny(150));
    assert!(a[0] > 3.9, "starts near ln 64: {}", a[0]);
    let tail = a[a.len() - 10..].iter().sum::<f64>() / 10.0;
    assert!(
        tail < 2.0,
        "mean loss of the last 10 steps {tail:.4} (entropy floor {floor:.4})"
    );
    assert!(
        tail > floor - 0.05,
        "cannot beat the entropy rate: {tail} vs {floor}"
    );
    let (b, _) = losses(tiny(150));
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "two runs differ"
    );
}

#[test]
fn bf16_storage_also_learns() {
    let mut c = tiny(60);
    c.bf16 = true;
    let (a, _) = losses(c);
    assert!(a[59] < a[0] - 1.0, "bf16 run: {} -> {}", a[0], a[59]);
}

#[test]
fn bad_settings_name_the_field() {
    let field = |c: TrainConfig| match Trainer::new(c) {
        Err(TrainError::Config { field, .. }) => field,
        Err(TrainError::Model(model::ModelError::Config { field, .. })) => field,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("accepted a bad config"),
    };
    let mut c = tiny(1);
    c.batch = 0;
    assert_eq!(field(c), "batch");
    let mut c = tiny(1);
    c.seq_len = 33;
    assert_eq!(field(c), "seq_len");
    let mut c = tiny(1);
    c.model.heads = 3;
    assert_eq!(field(c), "heads");
    let mut c = tiny(1);
    c.model.layers = 0;
    assert_eq!(field(c), "layers");
    let mut c = tiny(1);
    c.model.vocab = 0;
    assert_eq!(field(c), "vocab");
    let mut c = tiny(1);
    c.model.seq_len = 0;
    assert_eq!(field(c), "seq_len");
}

#[test]
fn a_diverging_run_is_an_error_naming_the_step() {
    let mut c = tiny(50);
    c.lr = 1e9;
    let mut t = Trainer::new(c).unwrap();
    let err = (0..50)
        .find_map(|_| t.step().err())
        .expect("lr 1e9 must blow up within 50 steps");
    match err {
        TrainError::Model(model::ModelError::NonFinite { step, .. }) => {
            assert!(step >= 2, "step {step}")
        }
        other => panic!("expected a non-finite error, got {other}"),
    }
}
