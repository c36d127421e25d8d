//! The loader's guarantees, over random datasets, seeds, world sizes, workers and resume points.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{token_at, write_dataset};
use data::{Dataset, Loader, LoaderConfig, LoaderState, Prefetch, SampleRef, SequenceSpace};
use proptest::prelude::*;

/// How the loaders of one property-test case cut and order the data.
#[derive(Clone, Copy)]
struct Setup {
    t: usize,
    g: u64,
    seed: u64,
    window: u64,
    workers: usize,
}

/// A loader for `rank` of `world`.
fn loader(
    ds: &Arc<Dataset>,
    s: Setup,
    world: u64,
    rank: u64,
    resume: Option<&LoaderState>,
) -> Loader {
    let mut c = LoaderConfig::new(s.t, s.g, s.seed);
    c.world = world;
    c.rank = rank;
    c.workers = s.workers;
    c.shuffle_window = s.window;
    c.timeout = Duration::from_secs(30);
    Loader::new(vec![ds.clone()], &c, resume).unwrap()
}

/// `steps` global batches as assembled from every rank's loader, in rank order, checking each
/// row's tokens against the shard contents.
fn global_batches(loaders: &mut [Loader], steps: usize, t: usize) -> Vec<Vec<SampleRef>> {
    (0..steps)
        .map(|_| {
            let mut global = Vec::new();
            for l in loaders.iter_mut() {
                let b = l.next().unwrap();
                for (i, s) in b.samples.iter().enumerate() {
                    let start = s.index * t as u64;
                    let want: Vec<u32> = (start..start + t as u64 + 1)
                        .map(|p| token_at(s.shard as usize, p))
                        .collect();
                    assert_eq!(b.row(i), want, "row {i} of {s:?}");
                }
                global.extend(b.samples);
            }
            global
        })
        .collect()
}

fn shard_docs() -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec(prop::collection::vec(1u64..60, 0..6), 1..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every epoch yields every sequence exactly once, for any world size and worker count, and
    /// the ranks' rows at each step are disjoint and make up the world-size-1 global batch.
    #[test]
    fn epochs_cover_every_sequence_once(
        docs in shard_docs(), t in 1usize..12, seed in any::<u64>(), window in 1u64..40,
        local in 1u64..4, world in 1u64..4, workers in 1usize..4,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let ds = write_dataset(dir.path(), &docs);
        let tokens: Vec<u64> = docs.iter().map(|d| d.iter().sum()).collect();
        let space = SequenceSpace::new(&tokens, t);
        prop_assume!(space.total() > 0);
        let n = space.total();
        let g = local * world;
        let steps = (2 * n).div_ceil(g) as usize;

        let setup = Setup { t, g, seed, window, workers };
        let mut ranks: Vec<Loader> = (0..world).map(|r| loader(&ds, setup, world, r, None)).collect();
        let per_step = global_batches(&mut ranks, steps, t);
        let mut single = vec![loader(&ds, Setup { workers: 1, ..setup }, 1, 0, None)];
        prop_assert_eq!(&per_step, &global_batches(&mut single, steps, t));

        let order: Vec<SampleRef> = per_step.concat();
        let all: HashSet<(u32, u64)> = space.per_shard().iter().enumerate()
            .flat_map(|(s, &k)| (0..k).map(move |i| (s as u32, i))).collect();
        for epoch in 0..2 {
            let slice = &order[(epoch * n) as usize..((epoch + 1) * n) as usize];
            let seen: HashSet<(u32, u64)> = slice.iter().map(|s| (s.shard, s.index)).collect();
            prop_assert_eq!(seen.len() as u64, n, "a sequence repeated in epoch {}", epoch);
            prop_assert_eq!(&seen, &all);
        }
    }

    /// Resuming at step k with world size W2 yields exactly what an uninterrupted W1 run yields
    /// from step k on.
    #[test]
    fn resume_on_another_world_size(
        docs in shard_docs(), t in 1usize..8, seed in any::<u64>(), window in 1u64..40,
        local in 1u64..3, w1 in 1u64..4, w2 in 1u64..4, k in 0usize..12, workers in 1usize..3,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let ds = write_dataset(dir.path(), &docs);
        let tokens: Vec<u64> = docs.iter().map(|d| d.iter().sum()).collect();
        prop_assume!(SequenceSpace::new(&tokens, t).total() > 0);
        // One global batch size both world sizes divide.
        let g = local * w1 * w2;
        let after = 5;

        let setup = Setup { t, g, seed, window, workers };
        let mut straight: Vec<Loader> = (0..w1).map(|r| loader(&ds, setup, w1, r, None)).collect();
        let expected = global_batches(&mut straight, k + after, t).split_off(k);

        let mut first: Vec<Loader> = (0..w1).map(|r| loader(&ds, setup, w1, r, None)).collect();
        global_batches(&mut first, k, t);
        let saved = LoaderState::from_json(&first[0].state().to_json()).unwrap();
        prop_assert_eq!(saved.steps, k as u64);
        drop(first);
        let mut resumed: Vec<Loader> =
            (0..w2).map(|r| loader(&ds, setup, w2, r, Some(&saved))).collect();
        prop_assert_eq!(global_batches(&mut resumed, after, t), expected);
    }
}

#[test]
fn mixture_follows_weights_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_dataset(&dir.path().join("a"), &[vec![400, 300], vec![500]]);
    let b = write_dataset(&dir.path().join("b"), &[vec![50, 60]]);
    let mut c = LoaderConfig::new(8, 20, 3);
    c.weights = vec![3.0, 1.0];
    let mut l = Loader::new(vec![a.clone(), b.clone()], &c, None).unwrap();
    let mut counts = [0usize; 2];
    let mut tail = Vec::new();
    let mut resumed = Vec::new();
    for step in 0..100 {
        if step == 60 {
            let state = l.state();
            let mut r = Loader::new(vec![a.clone(), b.clone()], &c, Some(&state)).unwrap();
            resumed = (0..40).map(|_| r.next().unwrap().samples).collect();
        }
        let batch = l.next().unwrap();
        for s in &batch.samples {
            counts[s.source as usize] += 1;
        }
        if step >= 60 {
            tail.push(batch.samples);
        }
    }
    assert_eq!(resumed, tail);
    // 3:1 over 2000 samples: each period of 1000 holds exactly 750 and 250.
    assert_eq!(counts, [1500, 500]);
    // Dataset a holds 699/8 + 499/8 = 87 + 62 = 149 sequences of 8: 1500 samples are 10 epochs.
    let s = l.state();
    assert_eq!((s.cursor, s.steps, s.epoch), (2000, 100, 1500 / 149));
}

#[test]
fn prefetch_never_exceeds_its_depth() {
    let dir = tempfile::tempdir().unwrap();
    let ds = write_dataset(dir.path(), &[vec![5000], vec![3000]]);
    for prefetch in [
        Prefetch::Fixed(1),
        Prefetch::Fixed(3),
        Prefetch::Auto { max: 5 },
    ] {
        let mut c = LoaderConfig::new(16, 4, 1);
        c.workers = 3;
        c.prefetch = prefetch;
        let mut l = Loader::new(vec![ds.clone()], &c, None).unwrap();
        for _ in 0..200 {
            l.next().unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        let limit = match prefetch {
            Prefetch::Fixed(k) => k,
            Prefetch::Auto { max } => max,
        };
        let m = l.metrics();
        assert!(m.max_outstanding <= limit, "{prefetch:?}: {m:?}");
        assert!(m.max_outstanding >= 1);
        assert_eq!(m.batches, 200);
        assert_eq!(m.tokens, 200 * 4 * 17);
        assert!(m.stall_pct() >= 0.0 && m.stall_pct() <= 100.0);
    }
}

#[test]
fn a_consumer_that_outpaces_its_worker_builds_batches_itself_in_the_same_order() {
    let dir = tempfile::tempdir().unwrap();
    let ds = write_dataset(dir.path(), &[vec![5000], vec![3000]]);
    let setup = Setup {
        t: 16,
        g: 4,
        seed: 7,
        window: 64,
        workers: 1,
    };
    // A consumer that takes each batch at once (it builds some itself), and one that computes
    // between batches (its batches are ready when it asks).
    let mut fast = [loader(&ds, setup, 1, 0, None)];
    let quick = global_batches(&mut fast, 300, setup.t);
    let mut slow = loader(&ds, setup, 1, 0, None);
    let paced: Vec<Vec<SampleRef>> = (0..300)
        .map(|_| {
            std::thread::sleep(Duration::from_micros(300));
            slow.next().unwrap().samples
        })
        .collect();
    assert_eq!(quick, paced);
    let m = fast[0].metrics();
    assert!(
        m.consumer_built > 0 && m.consumer_built <= m.batches,
        "{m:?}"
    );
    // Automatic depth, at most 16 (LoaderConfig::new): the consumer claims under the same bound.
    assert!(m.max_outstanding <= 16, "{m:?}");
}

#[test]
fn a_dataset_counts_as_verified_once_an_epoch_has_touched_every_shard() {
    let dir = tempfile::tempdir().unwrap();
    let ds = write_dataset(dir.path(), &[vec![700], vec![500], vec![300]]);
    assert!(!ds.all_verified());
    let setup = Setup {
        t: 16,
        g: 4,
        seed: 3,
        window: 32,
        workers: 2,
    };
    let mut l = [loader(&ds, setup, 1, 0, None)];
    let epoch = SequenceSpace::new(&[700, 500, 300], setup.t).total() as usize;
    global_batches(&mut l, epoch.div_ceil(4), setup.t);
    // The verifier thread stops once this holds (later epochs cost it nothing).
    assert!(ds.all_verified());
}

#[test]
fn bad_settings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let ds = write_dataset(dir.path(), &[vec![100]]);
    let mut c = LoaderConfig::new(8, 6, 1);
    c.world = 4;
    let err = Loader::new(vec![ds.clone()], &c, None)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("global_batch = world x local_batch"), "{err}");

    let c = LoaderConfig::new(500, 2, 1);
    let err = Loader::new(vec![ds.clone()], &c, None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("seq_len 500") && err.contains("100 tokens"),
        "{err}"
    );

    let c = LoaderConfig::new(8, 2, 1);
    let mut l = Loader::new(vec![ds.clone()], &c, None).unwrap();
    l.next().unwrap();
    let mut state = l.state();
    state.seed = 2;
    let err = Loader::new(vec![ds], &c, Some(&state))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("seed was 2 when saved, is 1 now"), "{err}");
}

#[test]
fn wide_token_ids_round_trip() {
    // A vocabulary above 65536 stores 4-byte ids; rows must come back exactly.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shard-00000.fts");
    let mut w = data::ShardWriter::create(&path, 100_000, "wide").unwrap();
    let ids: Vec<u32> = (0..200u32).map(|i| 70_000 + i * 97 % 29_000).collect();
    w.push_doc(&ids).unwrap();
    let info = w.finish().unwrap();
    data::Manifest::new("wide", 100_000, None, "tests", &[info])
        .write_atomic(dir.path())
        .unwrap();
    let ds = Arc::new(Dataset::open(dir.path()).unwrap());
    let mut l = Loader::new(vec![ds], &LoaderConfig::new(9, 4, 5), None).unwrap();
    let b = l.next().unwrap();
    for (i, s) in b.samples.iter().enumerate() {
        let start = (s.index * 9) as usize;
        assert_eq!(b.row(i), ids[start..start + 10].to_vec());
    }
}
