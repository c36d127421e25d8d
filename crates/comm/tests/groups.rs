//! Sub-groups running concurrently without cross-talk, async ops overlapping computation, and
//! the errors a misused or silent group must give (mismatch, timeout) instead of hanging.

use comm::group::{GroupConfig, OpOptions};
use comm::local::run_threads;
use comm::{CommError, ReduceOp};
use std::time::{Duration, Instant};

#[test]
fn concurrent_subgroups_do_not_cross_talk() {
    let res = run_threads(4, GroupConfig::default(), |g| {
        let r = g.rank();
        // Two overlapping families of sub-groups, created collectively over the world.
        let rows = [g.subgroup("row0", &[0, 1])?, g.subgroup("row1", &[2, 3])?];
        let cols = [g.subgroup("col0", &[0, 2])?, g.subgroup("col1", &[1, 3])?];
        let row = rows
            .into_iter()
            .flatten()
            .next()
            .expect("every rank is in one row");
        let col = cols
            .into_iter()
            .flatten()
            .next()
            .expect("every rank is in one column");
        // Run both at once from two threads, many times, with distinct payloads.
        let t_row = std::thread::spawn(move || -> comm::Result<Vec<f32>> {
            let mut last = Vec::new();
            for k in 0..50 {
                let mut v = vec![(r * 100 + k) as f32; 4097];
                row.all_reduce(&mut v, ReduceOp::Sum)?;
                last = v;
            }
            Ok(last)
        });
        let mut col_last = Vec::new();
        for k in 0..50 {
            let mut v = vec![(r * 10_000 + k) as f32; 3001];
            col.all_reduce(&mut v, ReduceOp::Sum)?;
            col_last = v;
        }
        let row_last = t_row.join().expect("row thread")?;
        Ok((row_last[0], col_last[0]))
    })
    .unwrap();
    let got: Vec<(f32, f32)> = res.into_iter().map(|r| r.unwrap()).collect();
    // Rows {0,1},{2,3}: sum of r*100+49; columns {0,2},{1,3}: sum of r*10000+49.
    let row = |a: usize, b: usize| (a * 100 + 49 + b * 100 + 49) as f32;
    let col = |a: usize, b: usize| (a * 10_000 + 49 + b * 10_000 + 49) as f32;
    assert_eq!(
        got,
        vec![
            (row(0, 1), col(0, 2)),
            (row(0, 1), col(1, 3)),
            (row(2, 3), col(0, 2)),
            (row(2, 3), col(1, 3))
        ]
    );
}

#[test]
fn subgroup_with_inconsistent_rank_lists_is_refused() {
    let res = run_threads(2, GroupConfig::default(), |g| {
        let ranks: &[usize] = if g.rank() == 0 { &[0, 1] } else { &[1, 0] };
        Ok(g.subgroup("bad", ranks).err().map(|e| e.to_string()))
    })
    .unwrap();
    for r in res {
        let msg = r.unwrap().expect("must be refused");
        assert!(msg.contains("different rank lists"), "{msg}");
    }
}

#[test]
fn async_ops_progress_while_caller_computes_and_keep_order() {
    let res = run_threads(3, GroupConfig::default(), |g| {
        let r = g.rank();
        let a = g.all_reduce_async(
            vec![(r + 1) as f64; 1 << 20],
            ReduceOp::Sum,
            OpOptions::default(),
        )?;
        let b = g.all_gather_async(vec![r as i32; 5], vec![0; 15], OpOptions::default())?;
        // "Compute" while the ops run in the background.
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        // A blocking op submitted after the async ones must run after them.
        let mut c = vec![r as i64; 3];
        g.all_reduce(&mut c, ReduceOp::Max)?;
        let a = a.wait()?;
        let (b_in, b) = b.wait()?;
        assert_eq!(b_in, vec![r as i32; 5], "the input comes back unchanged");
        Ok((a[12345], b, c))
    })
    .unwrap();
    for r in res {
        let (a, b, c) = r.unwrap();
        assert_eq!(a, 6.0);
        assert_eq!(b, vec![0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
        assert_eq!(c, vec![2, 2, 2]);
    }
}

#[test]
fn mismatched_calls_are_reported_not_hung() {
    let cfg = GroupConfig {
        timeout: Duration::from_secs(5),
        ..GroupConfig::default()
    };
    let t0 = Instant::now();
    let res = run_threads(2, cfg, |g| {
        let e = if g.rank() == 0 {
            let mut v = vec![1f32; 100];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
        } else {
            let mut out = vec![0f32; 200];
            g.all_gather(&[1f32; 100], &mut out).unwrap_err()
        };
        // The group is unusable afterwards, and says why.
        let again = g.barrier().unwrap_err();
        assert!(matches!(again, CommError::Aborted { .. }), "{again}");
        Ok(e)
    })
    .unwrap();
    let errs: Vec<CommError> = res.into_iter().map(|r| r.unwrap()).collect();
    assert!(
        errs.iter().any(|e| matches!(e, CommError::Mismatch { .. })),
        "{errs:?}"
    );
    let text = errs
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        text.contains("all_gather") && text.contains("all_reduce"),
        "{text}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "mismatch must be detected at once, took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_rank_that_never_calls_is_named_after_the_timeout() {
    let cfg = GroupConfig {
        timeout: Duration::from_millis(1500),
        ..GroupConfig::default()
    };
    let res = run_threads(3, cfg, |g| {
        if g.rank() == 2 {
            std::thread::sleep(Duration::from_secs(4));
            return Ok(None);
        }
        let t0 = Instant::now();
        let mut v = vec![1f32; 10];
        let e = g.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        Ok(Some((e, t0.elapsed())))
    })
    .unwrap();
    for (rank, r) in res.into_iter().enumerate().take(2) {
        let (e, took) = r.unwrap().expect("ranks 0 and 1 fail");
        assert!(
            took < Duration::from_millis(1500 + 2000),
            "rank {rank} took {took:?}"
        );
        let s = e.to_string();
        assert!(
            s.contains("all_reduce #") && s.contains("rank 2"),
            "rank {rank}: {s}"
        );
    }
}

#[test]
fn flight_recorder_keeps_recent_ops() {
    let res = run_threads(2, GroupConfig::default(), |g| {
        for _ in 0..3 {
            g.barrier()?;
        }
        let mut v = vec![0u8; 64];
        g.all_reduce(&mut v, ReduceOp::Max)?;
        Ok(g.flight_dump())
    })
    .unwrap();
    let dump = res[0].as_ref().unwrap();
    assert!(
        dump.contains("barrier") && dump.contains("all_reduce") && dump.contains("done"),
        "{dump}"
    );
}

/// A reducing receive whose elements straddle what a small shared-memory ring holds (the
/// stream is misaligned by an earlier odd-sized message) must still make progress: the engine
/// carries split elements instead of waiting for whole ones that the blocked writer cannot send.
#[test]
fn split_elements_in_a_small_ring_do_not_stall() {
    let cfg = GroupConfig {
        shm_ring_bytes: 4096,
        timeout: Duration::from_secs(20),
        calibrate: false,
        ..GroupConfig::default()
    };
    let res = run_threads(3, cfg, |g| {
        let mut out = vec![0u8; 9];
        g.all_gather(&[g.rank() as u8; 3], &mut out)?;
        let mut v: Vec<f32> = (0..100_001).map(|i| (i % 7) as f32).collect();
        let ring = OpOptions {
            algo: Some(comm::algo::Algo::Ring),
            timeout: None,
        };
        g.all_reduce_with(&mut v, ReduceOp::Sum, &ring)?;
        let mut w: Vec<f64> = vec![1.5; 30_001];
        g.all_reduce_with(&mut w, ReduceOp::Sum, &ring)?;
        Ok((v[100_000], w[0]))
    })
    .unwrap();
    for r in res {
        assert_eq!(r.unwrap(), ((100_000 % 7) as f32 * 3.0, 4.5));
    }
}

/// A rank that cannot join (here: its shared-memory directory does not exist) makes the others
/// fail within seconds with its reason, instead of waiting out the connect timeout.
#[test]
fn a_rank_failing_to_join_fails_the_others_fast() {
    use comm::group::ProcessGroup;
    let local = comm::local::LocalRendezvous::start().unwrap();
    let t0 = Instant::now();
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let rdv = local.rdv.clone();
            std::thread::spawn(move || {
                let mut cfg = GroupConfig::default();
                if rank == 2 {
                    cfg.shm_dir = "/nonexistent-flotilla-dir".into();
                }
                ProcessGroup::new(&rdv, "world", rank, 3, cfg)
                    .err()
                    .map(|e| e.to_string())
            })
        })
        .collect();
    let errs: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().unwrap().expect("every rank fails"))
        .collect();
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
    assert!(errs[2].contains("/nonexistent-flotilla-dir"), "{}", errs[2]);
    for e in &errs[..2] {
        assert!(e.contains("abandoned") && e.contains("rank 2"), "{e}");
    }
}

/// Two "hosts" of two ranks (host identity overridden per rank): the hierarchical all-reduce,
/// large enough to take the pipelined single-copy path, gives exact results on every rank.
#[test]
fn pipelined_hierarchical_all_reduce_across_two_hosts() {
    use comm::group::ProcessGroup;
    let local = comm::local::LocalRendezvous::start().unwrap();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            let rdv = local.rdv.clone();
            std::thread::spawn(move || -> comm::Result<Vec<f32>> {
                let cfg = GroupConfig {
                    host_id: Some(format!("host{}", rank / 2)),
                    timeout: Duration::from_secs(60),
                    ..GroupConfig::default()
                };
                let g = ProcessGroup::new(&rdv, "world", rank, 4, cfg)?;
                assert_eq!(g.host_of(), &[0, 0, 1, 1]);
                let hier = OpOptions {
                    algo: Some(comm::algo::Algo::Hierarchical),
                    timeout: None,
                };
                // 5M + 3 elements: 20 MB, three segments, the last one short and odd.
                let mut v: Vec<f32> = (0..5_000_003).map(|i| ((i + rank) % 13) as f32).collect();
                g.all_reduce_with(&mut v, ReduceOp::Sum, &hier)?;
                let mut w = vec![rank as f32; 1001];
                g.all_reduce_with(&mut w, ReduceOp::Max, &hier)?;
                assert_eq!(w[1000], 3.0);
                Ok(v)
            })
        })
        .collect();
    let outs: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    for i in [0usize, 1, 4_194_303, 4_194_304, 5_000_002] {
        let want: f32 = (0..4).map(|r| ((i + r) % 13) as f32).sum();
        for o in &outs {
            assert_eq!(o[i], want, "element {i}");
        }
    }
}
