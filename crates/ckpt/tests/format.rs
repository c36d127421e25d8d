//! The rank-file format (a safetensors file any safetensors reader opens), chunked checksums
//! with partial reads, and the asynchronous saver.

use std::time::Duration;

use ckpt::{
    AsyncSaver, Checkpoint, CheckpointMeta, CkptError, DType, RankWriter, Slice, TensorMeta,
    Verify, commit, open_latest, rank_file_name, step_dir_name,
};

/// An F32 tensor of `rows` x 1024 whose element i is i as f32.
fn big(rows: u64) -> (TensorMeta, Vec<u8>) {
    let meta = TensorMeta {
        name: "layers.0.w".into(),
        dtype: DType::F32,
        shape: vec![rows, 1024],
    };
    let data = (0..rows * 1024)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    (meta, data)
}

fn meta(tensors: &[TensorMeta], world: u32) -> CheckpointMeta {
    CheckpointMeta {
        run_id: "format".into(),
        world_size: world,
        layout: serde_json::json!({"dp": world}),
        config_hash: "cfg".into(),
        tensors: tensors.to_vec(),
        state: serde_json::json!({}),
    }
}

/// Saves `t` split into two row halves, one per rank; returns the step directory.
fn save_halves(root: &std::path::Path, t: &TensorMeta, data: &[u8]) -> std::path::PathBuf {
    let rows = t.shape[0];
    let half = rows / 2;
    let row_bytes = data.len() / rows as usize;
    let mut pieces = Vec::new();
    for (rank, (r0, n)) in [(0, half), (half, rows - half)].into_iter().enumerate() {
        let s = Slice::new(&[(r0, n), (0, 1024)]);
        let bytes = &data[r0 as usize * row_bytes..(r0 + n) as usize * row_bytes];
        pieces.extend(RankWriter::write_all(root, 1, rank as u32, &[(t, &s, bytes)]).unwrap());
    }
    commit(root, 1, pieces, meta(std::slice::from_ref(t), 2)).unwrap();
    root.join(step_dir_name(1))
}

#[test]
fn rank_files_are_safetensors_files() {
    let dir = tempfile::tempdir().unwrap();
    let (t, data) = big(6);
    let b = TensorMeta {
        name: "b".into(),
        dtype: DType::BF16,
        shape: vec![3],
    };
    let s0 = Slice::new(&[(0, 2), (0, 1024)]);
    let s1 = Slice::new(&[(2, 4), (0, 1024)]);
    let sb = Slice::new(&[(0, 3)]);
    let pieces = RankWriter::write_all(
        dir.path(),
        1,
        0,
        &[
            (&t, &s0, &data[..8192]),
            (&b, &sb, &[1, 2, 3, 4, 5, 6]),
            (&t, &s1, &data[8192..]),
        ],
    )
    .unwrap();
    let path = dir.path().join("step-1.tmp").join(rank_file_name(0));
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor("layers.0.w[0..2, 0..1024]").unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    assert_eq!(view.shape(), [2, 1024]);
    assert_eq!(view.data(), &data[..8192]);
    let view = st.tensor("layers.0.w[2..6, 0..1024]").unwrap();
    assert_eq!(view.data(), &data[8192..]);
    let view = st.tensor("b[0..3]").unwrap();
    assert_eq!(
        (view.dtype(), view.data()),
        (safetensors::Dtype::BF16, &[1, 2, 3, 4, 5, 6][..])
    );
    // The manifest's absolute byte ranges point at the same bytes, data aligned to 4 KiB.
    for p in &pieces {
        let key = format!("{}{}", p.tensor, p.slice);
        assert_eq!(
            &bytes[p.offset as usize..(p.offset + p.bytes) as usize],
            st.tensor(&key).unwrap().data()
        );
    }
    assert_eq!(pieces[0].offset % 4096, 0);
}

#[test]
fn partial_reads_verify_only_the_chunks_they_touch() {
    let dir = tempfile::tempdir().unwrap();
    // 2304 x 1024 f32 = 9 MiB: each rank's half is 4.5 MiB, i.e. two 4 MiB checksum chunks.
    let (t, data) = big(2304);
    let step = save_halves(dir.path(), &t, &data);
    let ckpt = Checkpoint::open(dir.path(), 1, Verify::AllPieces).unwrap();
    let piece = ckpt
        .manifest()
        .pieces
        .iter()
        .find(|p| p.file == rank_file_name(0))
        .unwrap();
    assert_eq!(piece.chunks.len(), 2);
    // Corrupt row 1100 (in rank 0's second chunk: rows 1024..1152).
    let pos = piece.offset + 1100 * 4096;
    let mut bytes = std::fs::read(step.join(&piece.file)).unwrap();
    bytes[pos as usize] ^= 0x40;
    std::fs::write(step.join(&piece.file), &bytes).unwrap();

    let ckpt = Checkpoint::open(dir.path(), 1, Verify::ManifestOnly).unwrap();
    let row_bytes = 4096;
    // Rows 0..1000 and 1200..2304 never touch the bad chunk.
    let a = ckpt
        .read_slice(&t.name, &Slice::new(&[(0, 1000), (0, 1024)]))
        .unwrap();
    assert_eq!(a, data[..1000 * row_bytes]);
    let b = ckpt
        .read_slice(&t.name, &Slice::new(&[(1200, 1104), (100, 10)]))
        .unwrap();
    let want: Vec<u8> = (1200..2304)
        .flat_map(|r| data[r * row_bytes + 400..r * row_bytes + 440].to_vec())
        .collect();
    assert_eq!(b, want);
    // Rows 1000..1200 do, and the error names the file and the chunk's byte range.
    let err = ckpt
        .read_slice(&t.name, &Slice::new(&[(1000, 200), (0, 1024)]))
        .unwrap_err();
    match &err {
        CkptError::PieceChecksum {
            file,
            offset,
            bytes,
            ..
        } => {
            assert_eq!(file, &rank_file_name(0));
            assert_eq!(*offset, piece.offset + (4 << 20));
            assert_eq!(*bytes, 1152 * 4096 - (4 << 20));
        }
        other => panic!("{other}"),
    }
    // A full verification rejects the step.
    assert!(open_latest(dir.path(), Verify::AllPieces).is_err());
}

#[test]
fn async_saves_commit_in_the_background_and_reuse_their_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let (t, mut data) = big(64);
    let full = Slice::full(&t.shape);
    let mut saver = AsyncSaver::new(dir.path(), 0).with_copy_threads(2);
    for step in 1..=3u64 {
        data[0] = step as u8;
        let (root, tm) = (dir.path().to_path_buf(), t.clone());
        let after: ckpt::AfterWrite =
            Box::new(move |step, pieces| commit(&root, step, pieces, meta(&[tm], 1)).map(drop));
        saver.save(step, &[(&t, &full, &data)], after).unwrap();
        assert_eq!(saver.pending(), Some(step));
        // The caller may change its state at once: the saver copied it.
        data[0] = 0xff;
        let refused = saver.save(step + 10, &[(&t, &full, &data)], Box::new(|_, _| Ok(())));
        assert!(matches!(
            refused,
            Err(CkptError::SaveInFlight { previous, .. }) if previous == step
        ));
        let report = saver.wait(Duration::from_secs(60)).unwrap().unwrap();
        assert_eq!((report.step, report.bytes), (step, data.len() as u64));
        assert_eq!(saver.pending(), None);
        let opened = open_latest(dir.path(), Verify::AllPieces).unwrap();
        assert_eq!(opened.checkpoint.step(), step);
        let got = opened.checkpoint.read_tensor(&t.name).unwrap();
        assert_eq!(got[0], step as u8);
        assert_eq!(got[1..], data[1..]);
    }
    assert!(saver.wait(Duration::from_secs(1)).unwrap().is_none());
}

#[test]
fn async_save_errors_reach_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let (t, data) = big(4);
    let full = Slice::full(&t.shape);
    let mut saver = AsyncSaver::new(dir.path(), 0);
    let after: ckpt::AfterWrite = Box::new(|step, _| {
        Err(CkptError::InjectedFailure {
            point: ckpt::FailPoint::AfterPiecesBeforeManifest,
            step,
        })
    });
    saver.save(5, &[(&t, &full, &data)], after).unwrap();
    let err = saver.wait(Duration::from_secs(60)).unwrap_err();
    assert!(
        matches!(err, CkptError::InjectedFailure { step: 5, .. }),
        "{err}"
    );
    // Nothing was committed, and the saver is usable again.
    assert!(ckpt::list_committed(dir.path()).unwrap().is_empty());
    let root = dir.path().to_path_buf();
    let tm = t.clone();
    let after: ckpt::AfterWrite =
        Box::new(move |step, pieces| commit(&root, step, pieces, meta(&[tm], 1)).map(drop));
    saver.save(6, &[(&t, &full, &data)], after).unwrap();
    saver.wait(Duration::from_secs(60)).unwrap();
    assert_eq!(ckpt::list_committed(dir.path()).unwrap(), vec![6]);
}
