//! A writer stopped at any fail point never yields a loadable new version; the previous committed
//! version still loads, and a retry of the same step succeeds over the debris.

mod common;

use ckpt::{Checkpoint, CkptError, FailPoint, Slice, Verify, list_committed, open_latest};
use common::{expected_slice, fixture, save, save_failing};

fn assert_loads_step(root: &std::path::Path, step: u64, seed: u64) {
    let opened = open_latest(root, Verify::AllPieces).unwrap();
    assert!(opened.rejected.is_empty(), "{:?}", opened.rejected);
    assert_eq!(opened.checkpoint.step(), step);
    for meta in fixture() {
        let full = Slice::full(&meta.shape);
        let got = opened.checkpoint.read_tensor(&meta.name).unwrap();
        assert!(
            got == expected_slice(&meta, &full, seed),
            "{} at step {step}",
            meta.name
        );
    }
}

#[test]
fn every_fail_point_leaves_previous_version_loadable() {
    for point in FailPoint::ALL {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        save(root, 1, &fixture(), 4, 1);
        let err = save_failing(root, 2, &fixture(), 2, point);
        assert!(
            matches!(err, CkptError::InjectedFailure { point: p, step: 2 } if p == point),
            "{point:?}: {err}"
        );
        assert_eq!(list_committed(root).unwrap(), vec![1], "{point:?}");
        assert!(
            Checkpoint::open(root, 2, Verify::ManifestOnly).is_err(),
            "{point:?}"
        );
        assert_loads_step(root, 1, 1);

        // Restarting the same step over the crash debris commits cleanly.
        save(root, 2, &fixture(), 4, 2);
        assert_eq!(list_committed(root).unwrap(), vec![1, 2], "{point:?}");
        assert_loads_step(root, 2, 2);
    }
}

#[test]
fn first_save_crashing_leaves_nothing_loadable() {
    let dir = tempfile::tempdir().unwrap();
    save_failing(
        dir.path(),
        5,
        &fixture(),
        1,
        FailPoint::AfterRenameBeforeMarker,
    );
    assert!(list_committed(dir.path()).unwrap().is_empty());
    let err = open_latest(dir.path(), Verify::ManifestOnly).unwrap_err();
    assert!(matches!(err, CkptError::NoCommittedStep { ref rejected, .. } if rejected.is_empty()));
}

#[test]
fn committed_step_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), 1, &fixture(), 4, 1);
    let err = ckpt::RankWriter::create(dir.path(), 1, 0).unwrap_err();
    assert!(matches!(err, CkptError::AlreadyCommitted { step: 1, .. }));
    assert_loads_step(dir.path(), 1, 1);
}

#[test]
fn poisoned_writer_refuses_further_use() {
    let dir = tempfile::tempdir().unwrap();
    let meta = &fixture()[0];
    let full = Slice::full(&meta.shape);
    let data = expected_slice(meta, &full, 0);
    let mut w = ckpt::RankWriter::create(dir.path(), 1, 0)
        .unwrap()
        .with_fail_point(FailPoint::MidPiece);
    assert!(matches!(
        w.write_piece(meta, &full, &data),
        Err(CkptError::InjectedFailure { .. })
    ));
    assert!(matches!(
        w.write_piece(meta, &full, &data),
        Err(CkptError::WriterPoisoned { .. })
    ));
    assert!(matches!(
        w.finish(),
        Err(CkptError::WriterPoisoned { rank: 0, step: 1 })
    ));
}

#[test]
fn writer_refuses_bad_input_without_poisoning() {
    let dir = tempfile::tempdir().unwrap();
    let meta = &fixture()[1]; // BF16 [9, 14]
    let mut w = ckpt::RankWriter::create(dir.path(), 1, 0).unwrap();
    let empty = Slice::new(&[(0, 0), (0, 14)]);
    assert!(matches!(
        w.write_piece(meta, &empty, &[]),
        Err(CkptError::Piece { .. })
    ));
    let outside = Slice::new(&[(8, 2), (0, 14)]);
    let err = w.write_piece(meta, &outside, &[0; 56]).unwrap_err();
    assert!(matches!(err, CkptError::SliceOutOfBounds { .. }));
    let rows = Slice::new(&[(0, 1), (0, 14)]);
    let err = w.write_piece(meta, &rows, &[0; 27]).unwrap_err();
    assert!(matches!(
        err,
        CkptError::BufferSize {
            expected: 28,
            actual: 27,
            ..
        }
    ));
    w.write_piece(meta, &rows, &[0; 28]).unwrap();
    assert_eq!(w.finish().unwrap().len(), 1);
}
