//! Uploading one locally committed step: verify locally, put every piece file and the manifest,
//! then the `COMMIT` object last.

use std::collections::BTreeSet;
use std::path::Path;

use super::{RemoteError, RemoteStore, Result, StoreError, object_key};
use crate::fsio::{checksum_hex, read_capped};
use crate::manifest::{
    COMMIT_FILE, CommitMarker, MANIFEST_FILE, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Manifest,
};
use crate::reader::{Checkpoint, Verify, step_dir_name};

/// Where an upload stops abruptly in crash tests, leaving the remote as a killed process would.
///
/// Objects are put in this order: every piece file (sorted by name), `manifest.json`, `COMMIT`;
/// `k` counts objects in that order from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadFailPoint {
    /// Stop after `k` objects were put completely, before starting object `k`.
    AfterObjects(usize),
    /// Put `k` objects, then stop in the middle of object `k`: a multipart upload is left
    /// incomplete after its first part; a single-put object is never sent.
    MidObject(usize),
}

/// What [`upload_step`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadReport {
    /// The step.
    pub step: u64,
    /// Objects put (0 when the remote already held this exact step).
    pub objects: usize,
    /// Bytes of all objects put.
    pub bytes: u64,
    /// The remote already had a `COMMIT` identical to the local one, so nothing was sent.
    pub already_durable: bool,
}

/// Uploads locally committed `step` of `local_root` to `store` (see the module doc).
///
/// Every piece is read and checked against the manifest with the local reader before anything
/// is sent, the manifest and marker bytes sent are checked to be the ones verified, and each
/// piece file's remote size is checked after its put (a fetch re-verifies every checksum). If the
/// remote already holds this step's `COMMIT`, an identical one makes this a no-op and a
/// different one is refused ([`RemoteError::RemoteConflict`]) rather than overwriting a
/// committed remote step's files.
pub fn upload_step(store: &RemoteStore, local_root: &Path, step: u64) -> Result<UploadReport> {
    upload_inner(store, local_root, step, None)
}

/// [`upload_step`] that stops abruptly at `point`, for crash tests.
pub fn upload_step_with_fail_point(
    store: &RemoteStore,
    local_root: &Path,
    step: u64,
    point: UploadFailPoint,
) -> Result<UploadReport> {
    upload_inner(store, local_root, step, Some(point))
}

/// One object to put.
enum Object<'a> {
    File(String),
    Bytes(&'static str, &'a [u8]),
}

/// Reads the raw marker and manifest bytes of a verified step and checks they are the bytes
/// that were verified (the step cannot have changed in between).
fn committed_bytes(dir: &Path, ckpt: &Checkpoint) -> Result<(Vec<u8>, Vec<u8>)> {
    let step = ckpt.step();
    let marker_bytes = read_capped(&dir.join(COMMIT_FILE), MAX_MARKER_BYTES)?;
    let manifest_bytes = read_capped(&dir.join(MANIFEST_FILE), MAX_MANIFEST_BYTES)?;
    let changed = |what: &str| RemoteError::Corrupt {
        step,
        key: object_key(step, what),
        reason: "local file changed while it was being verified".into(),
    };
    let marker: CommitMarker =
        serde_json::from_slice(&marker_bytes).map_err(|_| changed(COMMIT_FILE))?;
    if marker.step != step
        || marker.manifest_bytes != manifest_bytes.len() as u64
        || marker.manifest_xxh3_128 != checksum_hex(&manifest_bytes)
    {
        return Err(changed(COMMIT_FILE));
    }
    let manifest: Manifest =
        serde_json::from_slice(&manifest_bytes).map_err(|_| changed(MANIFEST_FILE))?;
    if manifest != *ckpt.manifest() {
        return Err(changed(MANIFEST_FILE));
    }
    Ok((marker_bytes, manifest_bytes))
}

fn upload_inner(
    store: &RemoteStore,
    local_root: &Path,
    step: u64,
    fail: Option<UploadFailPoint>,
) -> Result<UploadReport> {
    let ckpt = Checkpoint::open(local_root, step, Verify::AllPieces)?;
    let dir = local_root.join(step_dir_name(step));
    let (marker_bytes, manifest_bytes) = committed_bytes(&dir, &ckpt)?;
    let files: BTreeSet<&str> = ckpt
        .manifest()
        .pieces
        .iter()
        .map(|p| p.file.as_str())
        .collect();

    let commit_key = object_key(step, COMMIT_FILE);
    if store.object_size(&commit_key)?.is_some() {
        let remote = store.get_object(&commit_key, MAX_MARKER_BYTES)?;
        if remote == marker_bytes {
            return Ok(UploadReport {
                step,
                objects: 0,
                bytes: 0,
                already_durable: true,
            });
        }
        return Err(RemoteError::RemoteConflict { step });
    }

    let mut objects: Vec<Object> = files.iter().map(|f| Object::File(f.to_string())).collect();
    objects.push(Object::Bytes(MANIFEST_FILE, &manifest_bytes));
    objects.push(Object::Bytes(COMMIT_FILE, &marker_bytes));
    let mut report = UploadReport {
        step,
        objects: 0,
        bytes: 0,
        already_durable: false,
    };
    for (k, object) in objects.into_iter().enumerate() {
        let stop_mid = match fail {
            Some(point @ UploadFailPoint::AfterObjects(at)) if at == k => {
                return Err(RemoteError::InjectedFailure { point, step });
            }
            Some(UploadFailPoint::MidObject(at)) => at == k,
            _ => false,
        };
        match object {
            Object::File(name) => {
                let path = dir.join(&name);
                let len = std::fs::metadata(&path)
                    .map_err(crate::error::io_err("stat", &path))?
                    .len();
                let key = object_key(step, &name);
                if store.upload_file(&key, &path, stop_mid)? {
                    // Cheap check that the store holds the whole file before COMMIT can follow.
                    let size = store.object_size(&key)?;
                    if size != Some(len) {
                        return Err(StoreError::ObjectSize {
                            key,
                            size: size.unwrap_or(0),
                            expected: format!("{len} (the local file) after upload"),
                        }
                        .into());
                    }
                }
                report.bytes += len;
            }
            Object::Bytes(name, bytes) => {
                if !stop_mid {
                    store.put_object(&object_key(step, name), bytes.to_vec())?;
                }
                report.bytes += bytes.len() as u64;
            }
        }
        if let Some(point) = fail.filter(|_| stop_mid) {
            return Err(RemoteError::InjectedFailure { point, step });
        }
        report.objects += 1;
    }
    Ok(report)
}
