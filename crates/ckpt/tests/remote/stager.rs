//! Staged mode: the `Stager` records a step as durable only once the remote holds it, and its
//! queue is bounded with waits that time out.
use std::net::TcpListener;
use std::time::{Duration, Instant};

use ckpt::remote::{
    RemoteError, RemoteOptions, RemoteStore, StageState, Stager, StagerConfig, UploadFailPoint,
    fetch_latest, list_remote_committed, read_record,
};
use ckpt::{Checkpoint, Verify};

use super::remotes::Remote;
use super::{assert_content, save, step_files};

on_both!(stager_records_durable_commit);

fn stager_records_durable_commit(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 1, 1, false);
    save(local.path(), 2, 2, true);
    let wait = Duration::from_secs(120);

    // A stager that crashes before the remote COMMIT put: no REMOTE record, no remote step.
    let objects = step_files(local.path(), 2).len();
    let config = StagerConfig {
        fail_point: Some(UploadFailPoint::AfterObjects(objects - 1)),
        ..StagerConfig::default()
    };
    let stager = Stager::start(remote.store("staged"), local.path(), config).unwrap();
    stager.stage(2).unwrap();
    let err = stager.wait(2, wait).unwrap_err();
    assert!(
        matches!(err, RemoteError::UploadFailed { step: 2, .. }),
        "{err}"
    );
    let status = stager.status(2).unwrap();
    assert!(
        matches!(status.state, StageState::Failed { .. }),
        "{status:?}"
    );
    assert!(read_record(local.path(), 2).unwrap().is_none());
    stager.shutdown(wait).unwrap();
    let store = remote.store("staged");
    assert!(list_remote_committed(&store).unwrap().is_empty());

    // A working stager: the record appears once the remote holds the step.
    let stager = Stager::start(
        remote.store("staged"),
        local.path(),
        StagerConfig::default(),
    )
    .unwrap();
    assert!(matches!(
        stager.wait(1, Duration::from_millis(10)),
        Err(RemoteError::UnknownStep { step: 1 })
    ));
    assert!(
        stager.stage(3).is_err(),
        "step 3 was never committed locally"
    );
    stager.stage(1).unwrap();
    stager.stage(2).unwrap();
    for step in [1, 2] {
        let durable = stager.wait(step, wait).unwrap();
        let status = stager.status(step).unwrap();
        assert_eq!(status.state, StageState::Durable { at: durable });
        assert!(status.locally_committed <= durable);
        let record = read_record(local.path(), step).unwrap().unwrap();
        assert_eq!(record.step, step);
        assert!(record.locally_committed_unix_ms <= record.durably_committed_unix_ms);
    }
    assert_eq!(list_remote_committed(&store).unwrap(), vec![1, 2]);
    // The REMOTE record is local bookkeeping: the step still loads, and is not uploaded.
    assert_content(
        &Checkpoint::open(local.path(), 2, Verify::AllPieces).unwrap(),
        2,
    );
    stager.shutdown(wait).unwrap();

    // A new stager knows both steps are durable from their records.
    let stager = Stager::start(
        remote.store("staged"),
        local.path(),
        StagerConfig::default(),
    )
    .unwrap();
    assert!(matches!(
        stager.status(2).unwrap().state,
        StageState::Durable { .. }
    ));
    stager.wait(2, Duration::from_millis(10)).unwrap();
    let cache = tempfile::tempdir().unwrap();
    assert_content(&fetch_latest(&store, cache.path()).unwrap().checkpoint, 2);
}

/// An S3 remote nobody listens on keeps each upload in flight (retrying) for a few seconds,
/// which makes the queue policy observable: full queue refused after the enqueue timeout,
/// waits time out, and the upload finally fails without any REMOTE record.
#[test]
fn stager_queue_is_bounded_and_waits_time_out() {
    let local = tempfile::tempdir().unwrap();
    for step in [1, 2, 3] {
        save(local.path(), step, step, false);
    }
    let dead_port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let opts = RemoteOptions {
        endpoint: Some(format!("http://127.0.0.1:{dead_port}")),
        access_key_id: Some("test".into()),
        secret_access_key: Some("test".into()),
        allow_http: Some(true),
        retry_timeout: Some(Duration::from_secs(4)),
        ..RemoteOptions::default()
    };
    let store = RemoteStore::open("s3://nobody/run", &opts).unwrap();
    let config = StagerConfig {
        queue_capacity: 1,
        enqueue_timeout: Duration::from_millis(200),
        fail_point: None,
    };
    let stager = Stager::start(store, local.path(), config).unwrap();
    stager.stage(1).unwrap();
    // Step 1 leaves the queue for the worker; step 2 then fills the queue.
    let deadline = Instant::now() + Duration::from_secs(10);
    while stager.status(1).unwrap().state == StageState::Queued {
        assert!(
            Instant::now() < deadline,
            "the worker never picked step 1 up"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    stager.stage(2).unwrap();
    stager.stage(2).unwrap(); // already queued: a no-op, not a second entry
    let err = stager.stage(3).unwrap_err();
    assert!(
        matches!(err, RemoteError::QueueFull { step: 3, capacity: 1, waited_ms } if waited_ms >= 200),
        "{err}"
    );
    let err = stager.wait(1, Duration::from_millis(100)).unwrap_err();
    assert!(matches!(err, RemoteError::Timeout { step: 1, .. }), "{err}");
    let err = stager.wait(1, Duration::from_secs(60)).unwrap_err();
    assert!(
        matches!(err, RemoteError::UploadFailed { step: 1, .. }),
        "{err}"
    );
    assert!(read_record(local.path(), 1).unwrap().is_none());
    drop(stager);
}
