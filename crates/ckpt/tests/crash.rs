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
    let err = ckpt::RankWriter::create(dir.path(), 1, 0, &[]).unwrap_err();
    assert!(matches!(err, CkptError::AlreadyCommitted { step: 1, .. }));
    assert_loads_step(dir.path(), 1, 1);
}

#[test]
fn poisoned_writer_refuses_further_use() {
    let dir = tempfile::tempdir().unwrap();
    let meta = &fixture()[0];
    let full = Slice::full(&meta.shape);
    let data = expected_slice(meta, &full, 0);
    let mut w = ckpt::RankWriter::create(dir.path(), 1, 0, &[(meta, &full)])
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
fn writer_refuses_bad_plans() {
    let dir = tempfile::tempdir().unwrap();
    let meta = &fixture()[1]; // BF16 [9, 14]
    let create = |plan: &[(&ckpt::TensorMeta, &Slice)]| {
        ckpt::RankWriter::create(dir.path(), 1, 0, plan).unwrap_err()
    };
    let empty = Slice::new(&[(0, 0), (0, 14)]);
    assert!(matches!(create(&[(meta, &empty)]), CkptError::Piece { .. }));
    let outside = Slice::new(&[(8, 2), (0, 14)]);
    assert!(matches!(
        create(&[(meta, &outside)]),
        CkptError::SliceOutOfBounds { .. }
    ));
    let rows = Slice::new(&[(0, 1), (0, 14)]);
    let err = create(&[(meta, &rows), (meta, &rows)]);
    assert!(err.to_string().contains("planned twice"), "{err}");
}

#[test]
fn writer_keeps_to_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let meta = &fixture()[1]; // BF16 [9, 14]
    let (r0, r1) = (
        Slice::new(&[(0, 1), (0, 14)]),
        Slice::new(&[(1, 1), (0, 14)]),
    );
    let plan = [(meta, &r0), (meta, &r1)];
    // A short buffer is refused without poisoning the writer.
    let mut w = ckpt::RankWriter::create(dir.path(), 1, 0, &plan).unwrap();
    let err = w.write_piece(meta, &r0, &[0; 27]).unwrap_err();
    assert!(matches!(
        err,
        CkptError::BufferSize {
            expected: 28,
            actual: 27,
            ..
        }
    ));
    w.write_piece(meta, &r0, &[0; 28]).unwrap();
    // Finishing before the plan is complete names the missing piece.
    let err = w.finish().unwrap_err();
    assert!(err.to_string().contains("never written"), "{err}");
    // Writing out of order is refused and poisons the writer.
    let mut w = ckpt::RankWriter::create(dir.path(), 1, 0, &plan).unwrap();
    let err = w.write_piece(meta, &r1, &[0; 28]).unwrap_err();
    assert!(err.to_string().contains("where the plan has"), "{err}");
    assert!(matches!(w.finish(), Err(CkptError::WriterPoisoned { .. })));
    // In order, it completes.
    let mut w = ckpt::RankWriter::create(dir.path(), 1, 0, &plan).unwrap();
    w.write_piece(meta, &r0, &[0; 28]).unwrap();
    w.write_piece(meta, &r1, &[1; 28]).unwrap();
    assert_eq!(w.finish().unwrap().len(), 2);
}
