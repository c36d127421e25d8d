//! Remote storage and staged mode, against a real local S3-compatible server (moto, started by
//! each test) and against a `file://` remote.
//!
//! The S3 tests need `moto_server`: from `FLOTILLA_S3_SERVER`, else from `PATH`. When it is
//! missing they fail (they never pass silently): run `.ci/run`, or `pip install 'moto[server]'`.
#![cfg(feature = "s3")]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckpt::manifest::{COMMIT_FILE, MANIFEST_FILE};
use ckpt::remote::{
    RemoteError, RemoteOptions, RemoteStore, StageState, Stager, StagerConfig, UploadFailPoint,
    fetch_latest, fetch_step, list_remote_committed, read_record, upload_step,
    upload_step_with_fail_point,
};
use ckpt::{
    Checkpoint, CheckpointMeta, CommitMarker, DType, RankWriter, Slice, TensorMeta, Verify,
    checksum_hex, commit, list_committed, step_dir_name,
};

// ---------------------------------------------------------------------------------------------
// Saving: the only code that touches the writer API.

/// Bytes of rank 0's extra tensor when `big`: over the multipart threshold used below.
const BIG_BYTES: u64 = 6 << 20;

/// Contents of element `i` of `tensor` at `seed`.
fn byte(seed: u64, tensor: &str, i: u64) -> u8 {
    let h = tensor
        .bytes()
        .fold(seed, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    ((i ^ h).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8
}

fn tensors(big: bool) -> Vec<TensorMeta> {
    let mut t = vec![TensorMeta {
        name: "w".into(),
        dtype: DType::U8,
        shape: vec![8, 512],
    }];
    if big {
        t.push(TensorMeta {
            name: "e".into(),
            dtype: DType::U8,
            shape: vec![BIG_BYTES],
        });
    }
    t
}

/// Commits `step` under `root` from two ranks (row halves of `w`; rank 0 also writes `e`).
fn save(root: &Path, step: u64, seed: u64, big: bool) {
    let metas = tensors(big);
    let mut pieces = Vec::new();
    let all_of_e = Slice::new(&[(0, BIG_BYTES)]);
    for rank in 0..2u64 {
        let rows = Slice::new(&[(4 * rank, 4), (0, 512)]);
        let mut plan = vec![(&metas[0], &rows)];
        if rank == 0 && big {
            plan.push((&metas[1], &all_of_e));
        }
        let mut writer = RankWriter::create(root, step, rank as u32, &plan).unwrap();
        for (meta, slice) in plan {
            let data: Vec<u8> = if meta.name == "w" {
                (4 * rank * 512..(4 * rank + 4) * 512)
                    .map(|i| byte(seed, "w", i))
                    .collect()
            } else {
                (0..BIG_BYTES).map(|i| byte(seed, "e", i)).collect()
            };
            writer.write_piece(meta, slice, &data).unwrap();
        }
        pieces.extend(writer.finish().unwrap());
    }
    let meta = CheckpointMeta {
        run_id: "remote-test".into(),
        world_size: 2,
        layout: serde_json::json!("rows"),
        config_hash: "0".into(),
        tensors: metas,
        state: serde_json::json!({ "seed": seed }),
    };
    commit(root, step, pieces, meta).unwrap();
}

/// Asserts that `ckpt` holds exactly what [`save`] wrote with `seed`.
fn assert_content(ckpt: &Checkpoint, seed: u64) {
    assert_eq!(ckpt.state()["seed"], seed, "step {}", ckpt.step());
    for meta in &ckpt.manifest().tensors {
        let got = ckpt.read_tensor(&meta.name).unwrap();
        let want: Vec<u8> = (0..got.len() as u64)
            .map(|i| byte(seed, &meta.name, i))
            .collect();
        assert!(got == want, "tensor {} of step {}", meta.name, ckpt.step());
    }
}

/// Every file of a committed step (piece files from the manifest, manifest, marker).
fn step_files(root: &Path, step: u64) -> Vec<String> {
    let ckpt = Checkpoint::open(root, step, Verify::ManifestOnly).unwrap();
    let mut files: Vec<String> = ckpt
        .manifest()
        .pieces
        .iter()
        .map(|p| p.file.clone())
        .collect();
    files.sort();
    files.dedup();
    files.extend([MANIFEST_FILE.to_string(), COMMIT_FILE.to_string()]);
    files
}

// ---------------------------------------------------------------------------------------------
// Remotes.

/// A moto S3 server on a free loopback port, killed on drop.
struct S3Server {
    child: Child,
    endpoint: String,
    _log_dir: tempfile::TempDir,
}

/// The moto server binary: `FLOTILLA_S3_SERVER`, else `moto_server` on `PATH`; fails the test
/// with instructions when there is none.
fn find_server() -> PathBuf {
    const HINT: &str = "run `.ci/run` (it installs moto into /opt/flotilla-s3), or \
                        `pip install 'moto[server]'`, or set FLOTILLA_S3_SERVER to moto_server";
    if let Some(p) = std::env::var_os("FLOTILLA_S3_SERVER") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FLOTILLA_S3_SERVER={} is not a file: {HINT}",
            p.display()
        );
        return p;
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("moto_server"))
            .find(|p| p.is_file())
    });
    on_path.unwrap_or_else(|| panic!("no S3 test server (moto_server is not on PATH): {HINT}"))
}

impl S3Server {
    fn start() -> S3Server {
        let bin = find_server();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log_dir = tempfile::tempdir().unwrap();
        let log = log_dir.path().join("moto.log");
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let mut server = S3Server {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            _log_dir: log_dir,
        };
        server.wait_ready(port, &log);
        server
    }

    /// Waits (at most 60 s) until the server answers, then creates the test bucket.
    fn wait_ready(&mut self, port: u16, log: &Path) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let err = std::fs::read_to_string(log.with_extension("err")).unwrap_or_default();
                panic!("moto_server exited with {status}: {err}");
            }
            if let Some(reply) = put_bucket(port) {
                assert!(
                    reply.starts_with("HTTP/1.1 200"),
                    "creating bucket: {reply}"
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not answer within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Sends `PUT /flotilla` (create bucket); `None` while nothing listens yet.
fn put_bucket(port: u16) -> Option<String> {
    let addr = ([127, 0, 0, 1], port).into();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let req = format!(
        "PUT /flotilla HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).ok()?;
    Some(reply)
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A remote to test against: a moto bucket or a directory; each test uses its own prefixes.
struct Remote {
    base: String,
    opts: RemoteOptions,
    _server: Option<S3Server>,
    _dir: Option<tempfile::TempDir>,
}

impl Remote {
    fn s3() -> Remote {
        let server = S3Server::start();
        let opts = RemoteOptions {
            endpoint: Some(server.endpoint.clone()),
            region: Some("us-east-1".into()),
            access_key_id: Some("test".into()),
            secret_access_key: Some("test".into()),
            allow_http: Some(true),
            retry_timeout: Some(Duration::from_secs(20)),
            ..small_parts()
        };
        Remote {
            base: "s3://flotilla".into(),
            opts,
            _server: Some(server),
            _dir: None,
        }
    }

    fn file() -> Remote {
        let dir = tempfile::tempdir().unwrap();
        Remote {
            base: format!("file://{}", dir.path().display()),
            opts: small_parts(),
            _server: None,
            _dir: Some(dir),
        }
    }

    fn store(&self, prefix: &str) -> RemoteStore {
        RemoteStore::open(&format!("{}/{prefix}", self.base), &self.opts).unwrap()
    }
}

/// Multipart above 1 MiB, in 5 MiB parts (S3's minimum), so the big rank file takes 2 parts.
fn small_parts() -> RemoteOptions {
    RemoteOptions {
        multipart_threshold: Some(1 << 20),
        part_size: Some(5 << 20),
        ..RemoteOptions::default()
    }
}

/// Runs each scenario against both remotes as `<scenario>::s3` and `<scenario>::file`.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn s3() {
                super::$name(&super::Remote::s3());
            }
            #[test]
            fn file() {
                super::$name(&super::Remote::file());
            }
        }
    )*};
}

on_both!(
    round_trip,
    crash_during_staging,
    corrupt_remote_objects,
    hostile_remote_manifest,
    stager_records_durable_commit
);

// ---------------------------------------------------------------------------------------------
// Scenarios.

fn round_trip(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 10, 10, true);
    save(local.path(), 20, 20, false);
    let store = remote.store("run");
    for step in [10, 20] {
        let report = upload_step(&store, local.path(), step).unwrap();
        assert_eq!(report.objects, step_files(local.path(), step).len());
        assert!(!report.already_durable);
    }
    // Uploading again is a no-op.
    assert!(
        upload_step(&store, local.path(), 20)
            .unwrap()
            .already_durable
    );
    assert_eq!(list_remote_committed(&store).unwrap(), vec![10, 20]);

    let cache = tempfile::tempdir().unwrap();
    let fetched = fetch_latest(&store, cache.path()).unwrap();
    assert!(fetched.rejected.is_empty(), "{:?}", fetched.rejected);
    assert_eq!(fetched.checkpoint.step(), 20);
    assert_content(&fetched.checkpoint, 20);
    let older = fetch_step(&store, 10, cache.path()).unwrap();
    assert_content(&older, 10);
    assert_eq!(list_committed(cache.path()).unwrap(), vec![10, 20]);
    for step in [10, 20] {
        for file in step_files(local.path(), step) {
            let dir = step_dir_name(step);
            let a = std::fs::read(local.path().join(&dir).join(&file)).unwrap();
            let b = std::fs::read(cache.path().join(&dir).join(&file)).unwrap();
            assert!(
                a == b,
                "step {step} file {file} differs after the round trip"
            );
        }
    }
    // A second fetch into the same cache reuses the verified copy.
    assert_content(&fetch_step(&store, 10, cache.path()).unwrap(), 10);
}

fn crash_during_staging(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 1, 1, false);
    save(local.path(), 2, 2, true);
    let objects = step_files(local.path(), 2).len();
    let points = (0..objects).flat_map(|k| {
        [
            UploadFailPoint::AfterObjects(k),
            UploadFailPoint::MidObject(k),
        ]
    });
    for (i, point) in points.enumerate() {
        let store = remote.store(&format!("crash-{i}"));
        upload_step(&store, local.path(), 1).unwrap();
        let err = upload_step_with_fail_point(&store, local.path(), 2, point).unwrap_err();
        assert!(
            matches!(err, RemoteError::InjectedFailure { point: p, step: 2 } if p == point),
            "{point:?}: {err}"
        );
        // The remote never shows step 2; readers of the remote load step 1.
        assert_eq!(list_remote_committed(&store).unwrap(), vec![1], "{point:?}");
        let cache = tempfile::tempdir().unwrap();
        let fetched = fetch_latest(&store, cache.path()).unwrap();
        assert_eq!(fetched.checkpoint.step(), 1, "{point:?}");
        assert!(
            fetched.rejected.is_empty(),
            "{point:?}: {:?}",
            fetched.rejected
        );
        assert_content(&fetched.checkpoint, 1);
        assert!(fetch_step(&store, 2, cache.path()).is_err(), "{point:?}");
        assert_eq!(list_committed(cache.path()).unwrap(), vec![1], "{point:?}");
        // The local commit is untouched, and a retry over the remote debris succeeds.
        assert_content(
            &Checkpoint::open(local.path(), 2, Verify::AllPieces).unwrap(),
            2,
        );
        upload_step(&store, local.path(), 2).unwrap();
        assert_eq!(
            list_remote_committed(&store).unwrap(),
            vec![1, 2],
            "{point:?}"
        );
        assert_content(&fetch_step(&store, 2, cache.path()).unwrap(), 2);
    }
}

/// Flips one byte of the object `file` of `step`, inside its first piece when it is a piece file.
fn flip_remote_byte(store: &RemoteStore, local: &Path, step: u64, file: &str) {
    let ckpt = Checkpoint::open(local, step, Verify::ManifestOnly).unwrap();
    let at = ckpt
        .manifest()
        .pieces
        .iter()
        .find(|p| p.file == file)
        .map_or(10, |p| p.offset + p.bytes / 2);
    let key = format!("{}/{file}", step_dir_name(step));
    let mut bytes = store.get_object(&key, 64 << 20).unwrap();
    bytes[at as usize] ^= 0x40;
    store.put_object(&key, bytes).unwrap();
}

fn corrupt_remote_objects(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    for step in [1, 2, 3] {
        save(local.path(), step, step, false);
    }
    let store = remote.store("corrupt");
    for step in [1, 2, 3] {
        upload_step(&store, local.path(), step).unwrap();
    }
    let piece_file = step_files(local.path(), 3)[0].clone();
    flip_remote_byte(&store, local.path(), 3, &piece_file);
    flip_remote_byte(&store, local.path(), 2, MANIFEST_FILE);

    let cache = tempfile::tempdir().unwrap();
    let fetched = fetch_latest(&store, cache.path()).unwrap();
    assert_eq!(fetched.checkpoint.step(), 1);
    assert_content(&fetched.checkpoint, 1);
    let rejected: Vec<(u64, String)> = fetched
        .rejected
        .iter()
        .map(|r| (r.step, r.error.to_string()))
        .collect();
    assert_eq!(rejected.len(), 2, "{rejected:?}");
    assert_eq!(rejected[0].0, 3);
    assert!(
        rejected[0].1.contains(&piece_file) && rejected[0].1.contains("checksum"),
        "{rejected:?}"
    );
    assert_eq!(rejected[1].0, 2);
    assert!(
        rejected[1].1.contains(MANIFEST_FILE) && rejected[1].1.contains("checksum"),
        "{rejected:?}"
    );
    // Nothing that failed verification became visible in the cache.
    assert_eq!(list_committed(cache.path()).unwrap(), vec![1]);
}

/// Publishes a remote step `step` whose manifest is `manifest` (with a matching marker).
fn put_forged_step(store: &RemoteStore, step: u64, manifest: &serde_json::Value) {
    let bytes = serde_json::to_vec(manifest).unwrap();
    let marker = CommitMarker {
        format: ckpt::manifest::FORMAT.into(),
        step,
        manifest_bytes: bytes.len() as u64,
        manifest_xxh3_128: checksum_hex(&bytes),
    };
    let dir = step_dir_name(step);
    store
        .put_object(&format!("{dir}/{MANIFEST_FILE}"), bytes)
        .unwrap();
    store
        .put_object(
            &format!("{dir}/{COMMIT_FILE}"),
            serde_json::to_vec(&marker).unwrap(),
        )
        .unwrap();
}

fn hostile_remote_manifest(remote: &Remote) {
    let local = tempfile::tempdir().unwrap();
    save(local.path(), 1, 1, false);
    let store = remote.store("hostile");
    upload_step(&store, local.path(), 1).unwrap();
    let manifest_key = format!("{}/{MANIFEST_FILE}", step_dir_name(1));
    let original: serde_json::Value =
        serde_json::from_slice(&store.get_object(&manifest_key, 1 << 20).unwrap()).unwrap();
    // Step 2 names its first piece file `../x`, step 3 an absolute path; both keep the bytes
    // reachable under those names where an object key can say so.
    for (step, name) in [(2u64, "../x"), (3, "/tmp/flotilla-hostile-x")] {
        let mut forged = original.clone();
        forged["step"] = step.into();
        let first = forged["pieces"][0]["file"].as_str().unwrap().to_string();
        for piece in forged["pieces"].as_array_mut().unwrap() {
            if piece["file"] == first.as_str() {
                piece["file"] = name.into();
            }
        }
        let data = store
            .get_object(&format!("{}/{first}", step_dir_name(1)), 1 << 30)
            .unwrap();
        store
            .put_object(&format!("{}/x", step_dir_name(step)), data.clone())
            .unwrap();
        store.put_object("x", data).unwrap();
        put_forged_step(&store, step, &forged);
    }
    assert_eq!(list_remote_committed(&store).unwrap(), vec![1, 2, 3]);

    let parent = tempfile::tempdir().unwrap();
    let cache = parent.path().join("cache");
    for step in [2, 3] {
        let err = fetch_step(&store, step, &cache).unwrap_err();
        assert!(err.to_string().contains("unsafe file name"), "{err}");
    }
    let fetched = fetch_latest(&store, &cache).unwrap();
    assert_eq!(fetched.checkpoint.step(), 1);
    let steps: Vec<u64> = fetched.rejected.iter().map(|r| r.step).collect();
    assert_eq!(steps, vec![3, 2]);
    // Nothing was written outside the cache, and no forged step became visible in it.
    let outside: Vec<_> = std::fs::read_dir(parent.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(outside, vec![std::ffi::OsString::from("cache")]);
    assert!(!Path::new("/tmp/flotilla-hostile-x").exists());
    assert_eq!(list_committed(&cache).unwrap(), vec![1]);
}

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

// ---------------------------------------------------------------------------------------------
// Without a server.

#[test]
fn bad_urls_are_refused() {
    for url in [
        "http://bucket/x",
        "s3://",
        "s3:///prefix",
        "file://relative/dir",
    ] {
        let err = RemoteStore::open(url, &RemoteOptions::default()).unwrap_err();
        assert!(matches!(err, RemoteError::Config(_)), "{url}: {err}");
    }
    let tiny_parts = RemoteOptions {
        part_size: Some(1 << 20),
        ..RemoteOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    assert!(RemoteStore::open(&url, &tiny_parts).is_err());
}

#[test]
fn empty_remote_has_nothing_to_fetch() {
    let remote = Remote::file();
    let store = remote.store("empty");
    assert!(list_remote_committed(&store).unwrap().is_empty());
    let cache = tempfile::tempdir().unwrap();
    let err = fetch_latest(&store, cache.path()).unwrap_err();
    assert!(
        matches!(err, RemoteError::NoRemoteCommittedStep { .. }),
        "{err}"
    );
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
