//! The synchronous facade over an `object_store` store: opening from a URL, single-key puts,
//! multipart uploads of files, capped and ranged downloads, and listing step prefixes.
//!
//! Each [`RemoteStore`] owns one tokio current-thread runtime and blocks on it, so callers stay
//! synchronous. Keys are relative to the store's prefix (`step-7/manifest.json`).

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart};

use crate::{Result, StoreError, io_err};

/// Files up to this size are uploaded with one put by default; larger ones as multipart uploads.
const DEFAULT_MULTIPART_THRESHOLD: u64 = 64 << 20;
/// Default part size of multipart uploads (S3 requires at least 5 MiB for all but the last).
const DEFAULT_PART_SIZE: usize = 16 << 20;
/// Smallest part size accepted (S3's minimum).
const MIN_PART_SIZE: usize = 5 << 20;
/// Parts of one multipart upload in flight at once.
const PARTS_IN_FLIGHT: usize = 4;
/// Size of each ranged GET when downloading a file.
const DOWNLOAD_CHUNK: u64 = 8 << 20;

/// How to reach a remote store; every field left `None` falls back to the usual `AWS_*`
/// environment variables (`AWS_ENDPOINT`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP`) for `s3://` URLs, then to
/// this module's defaults. `file://` URLs use only the size fields.
#[derive(Clone, Default)]
pub struct RemoteOptions {
    /// S3 endpoint, e.g. `http://127.0.0.1:9000` for a local server (path-style requests).
    pub endpoint: Option<String>,
    /// Region (`us-east-1` when an endpoint is given and no region is set anywhere).
    pub region: Option<String>,
    /// Access key id.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Session token.
    pub session_token: Option<String>,
    /// Allow plain-HTTP endpoints.
    pub allow_http: Option<bool>,
    /// Give up retrying a failed request after this long (default 3 minutes).
    pub retry_timeout: Option<Duration>,
    /// Files larger than this are uploaded as multipart uploads (default 64 MiB).
    pub multipart_threshold: Option<u64>,
    /// Part size of multipart uploads (default 16 MiB, at least 5 MiB).
    pub part_size: Option<usize>,
}

impl std::fmt::Debug for RemoteOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("RemoteOptions")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &redact(&self.secret_access_key))
            .field("session_token", &redact(&self.session_token))
            .field("allow_http", &self.allow_http)
            .field("retry_timeout", &self.retry_timeout)
            .field("multipart_threshold", &self.multipart_threshold)
            .field("part_size", &self.part_size)
            .finish()
    }
}

/// A remote store (S3-compatible bucket or directory) under a prefix, used synchronously.
pub struct RemoteStore {
    url: String,
    pub(crate) store: Arc<dyn ObjectStore>,
    prefix: String,
    pub(crate) runtime: tokio::runtime::Runtime,
    multipart_threshold: u64,
    part_size: usize,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("url", &self.url)
            .field("multipart_threshold", &self.multipart_threshold)
            .field("part_size", &self.part_size)
            .finish_non_exhaustive()
    }
}

fn config(reason: impl Into<String>) -> StoreError {
    StoreError::Config(reason.into())
}

pub(crate) fn store_err(
    op: &'static str,
    key: &str,
) -> impl FnOnce(object_store::Error) -> StoreError {
    let key = key.to_string();
    move |e| match e {
        object_store::Error::NotFound { .. } => StoreError::Missing { key },
        source => StoreError::Store {
            op,
            key,
            source: Box::new(source),
        },
    }
}

/// Builds the S3 store for `bucket`, explicit options over `AWS_*` variables.
fn build_s3(bucket: &str, opts: &RemoteOptions) -> Result<Arc<dyn ObjectStore>> {
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(v) = &opts.endpoint {
        b = b.with_endpoint(v);
    }
    let env_region = std::env::var("AWS_DEFAULT_REGION").or_else(|_| std::env::var("AWS_REGION"));
    match (&opts.region, env_region) {
        (Some(v), _) => b = b.with_region(v),
        (None, Ok(v)) => b = b.with_region(v),
        (None, Err(_)) => b = b.with_region("us-east-1"),
    }
    if let Some(v) = &opts.access_key_id {
        b = b.with_access_key_id(v);
    }
    if let Some(v) = &opts.secret_access_key {
        b = b.with_secret_access_key(v);
    }
    if let Some(v) = &opts.session_token {
        b = b.with_token(v);
    }
    if let Some(v) = opts.allow_http {
        b = b.with_allow_http(v);
    }
    if let Some(t) = opts.retry_timeout {
        b = b.with_retry(RetryConfig {
            retry_timeout: t,
            ..RetryConfig::default()
        });
    }
    let store = b
        .build()
        .map_err(|e| config(format!("s3 bucket {bucket:?}: {e}")))?;
    Ok(Arc::new(store))
}

impl RemoteStore {
    /// Opens `s3://bucket[/prefix]` or `file:///absolute/dir` (created if missing).
    pub fn open(url: &str, opts: &RemoteOptions) -> Result<Self> {
        let (store, prefix): (Arc<dyn ObjectStore>, String) =
            if let Some(rest) = url.strip_prefix("s3://") {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(config(format!("{url:?}: no bucket")));
                }
                (
                    build_s3(bucket, opts)?,
                    prefix.trim_matches('/').to_string(),
                )
            } else if let Some(dir) = url.strip_prefix("file://") {
                if !dir.starts_with('/') {
                    return Err(config(format!("{url:?}: file URLs need an absolute path")));
                }
                let dir = FsPath::new(dir);
                std::fs::create_dir_all(dir).map_err(io_err("create dir", dir))?;
                let fs = LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| config(format!("{url:?}: {e}")))?
                    .with_fsync(true);
                (Arc::new(fs), String::new())
            } else {
                return Err(config(format!(
                    "{url:?}: expected s3://bucket/prefix or file:///dir"
                )));
            };
        if !prefix.is_empty() {
            Path::parse(&prefix).map_err(|e| config(format!("{url:?}: bad prefix: {e}")))?;
        }
        let part_size = opts.part_size.unwrap_or(DEFAULT_PART_SIZE);
        if part_size < MIN_PART_SIZE {
            return Err(config(format!(
                "part size {part_size} is below the minimum {MIN_PART_SIZE}"
            )));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(StoreError::Runtime)?;
        Ok(RemoteStore {
            url: url.to_string(),
            store,
            prefix,
            runtime,
            multipart_threshold: opts
                .multipart_threshold
                .unwrap_or(DEFAULT_MULTIPART_THRESHOLD),
            part_size,
        })
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The full object path of `key` (relative to the prefix); refuses keys that are not clean
    /// `/`-separated names.
    pub(crate) fn path(&self, key: &str) -> Result<Path> {
        let full = if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        };
        Path::parse(&full).map_err(|e| StoreError::BadKey {
            key: key.to_string(),
            reason: e.to_string(),
        })
    }

    /// Puts `bytes` at `key` in one request (atomic: the object is all or nothing).
    pub fn put_object(&self, key: &str, bytes: Vec<u8>) -> Result<()> {
        let path = self.path(key)?;
        self.runtime
            .block_on(self.store.put(&path, PutPayload::from(bytes)))
            .map_err(store_err("put", key))?;
        Ok(())
    }

    /// Size of the object at `key`, or `None` if there is none.
    pub fn object_size(&self, key: &str) -> Result<Option<u64>> {
        let path = self.path(key)?;
        match self.runtime.block_on(self.store.head(&path)) {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err("head", key)(e)),
        }
    }

    /// Downloads the whole object at `key`, refusing it (before downloading) if it is larger
    /// than `cap` bytes.
    pub fn get_object(&self, key: &str, cap: u64) -> Result<Vec<u8>> {
        let size = self.object_size(key)?.ok_or_else(|| StoreError::Missing {
            key: key.to_string(),
        })?;
        if size > cap {
            return Err(StoreError::ObjectSize {
                key: key.to_string(),
                size,
                expected: format!("at most {cap}"),
            });
        }
        let mut out = Vec::with_capacity(size as usize);
        self.read_ranges(key, size, |chunk| {
            out.extend_from_slice(chunk);
            Ok(())
        })?;
        Ok(out)
    }

    /// Deletes the object at `key` (no error if it does not exist).
    pub fn delete_object(&self, key: &str) -> Result<()> {
        let path = self.path(key)?;
        match self.runtime.block_on(self.store.delete(&path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_err("delete", key)(e)),
        }
    }

    /// Names of the "directories" directly under the prefix (e.g. `step-7`).
    pub fn list_dirs(&self) -> Result<Vec<String>> {
        let prefix = if self.prefix.is_empty() {
            None
        } else {
            Some(self.path("")?)
        };
        let listed = match self
            .runtime
            .block_on(self.store.list_with_delimiter(prefix.as_ref()))
        {
            Ok(listed) => listed,
            // A directory remote that nothing was uploaded to yet.
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(store_err("list", "")(e)),
        };
        Ok(listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// Downloads `size` bytes of `key` in ranged requests, handing each chunk to `sink`; fails
    /// if the store returns a different number of bytes than asked for.
    fn read_ranges(
        &self,
        key: &str,
        size: u64,
        mut sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let path = self.path(key)?;
        let mut at = 0;
        while at < size {
            let end = size.min(at + DOWNLOAD_CHUNK);
            let chunk = self
                .runtime
                .block_on(self.store.get_range(&path, at..end))
                .map_err(store_err("get", key))?;
            if chunk.len() as u64 != end - at {
                return Err(StoreError::ObjectSize {
                    key: key.to_string(),
                    size: at + chunk.len() as u64,
                    expected: format!("range {at}..{end} in full"),
                });
            }
            sink(&chunk)?;
            at = end;
        }
        Ok(())
    }

    /// Downloads the object at `key`, which must be exactly `size` bytes, into `file` (at its
    /// current position); `path` names the file in errors.
    pub fn download_to(&self, key: &str, size: u64, file: &mut File, path: &FsPath) -> Result<()> {
        self.read_ranges(key, size, |chunk| {
            file.write_all(chunk).map_err(io_err("write", path))?;
            Ok(())
        })
    }

    /// Uploads the local file at `path` to `key`: one put up to the multipart threshold, a
    /// multipart upload above it. With `stop_mid` it stops as a crash would: a multipart upload
    /// is left incomplete after its first part, a single put is never sent; it then returns
    /// `Ok(false)`. Returns `Ok(true)` once the object is complete.
    pub fn upload_file(&self, key: &str, path: &FsPath, stop_mid: bool) -> Result<bool> {
        let mut file = File::open(path).map_err(io_err("open", path))?;
        let len = file.metadata().map_err(io_err("stat", path))?.len();
        if len <= self.multipart_threshold {
            if stop_mid {
                return Ok(false);
            }
            let mut bytes = Vec::with_capacity(len as usize);
            (&mut file)
                .take(len)
                .read_to_end(&mut bytes)
                .map_err(io_err("read", path))?;
            self.put_object(key, bytes)?;
            return Ok(true);
        }
        let object = self.path(key)?;
        let upload = self
            .runtime
            .block_on(self.store.put_multipart(&object))
            .map_err(store_err("start multipart", key))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.part_size);
        match self.write_parts(&mut writer, &mut file, path, key, stop_mid) {
            Ok(true) => {
                self.runtime
                    .block_on(writer.finish())
                    .map_err(store_err("complete multipart", key))?;
                Ok(true)
            }
            // A crash leaves the incomplete upload behind: dropping the writer sends nothing.
            Ok(false) => Ok(false),
            Err(e) => {
                // Best effort: the error being reported matters more than the abort's.
                let _ = self.runtime.block_on(writer.abort());
                Err(e)
            }
        }
    }

    /// Streams `file` into `writer` part by part, with a bounded number of parts in flight.
    fn write_parts(
        &self,
        writer: &mut WriteMultipart,
        file: &mut File,
        path: &FsPath,
        key: &str,
        stop_mid: bool,
    ) -> Result<bool> {
        // `WriteMultipart::write` spawns the part uploads onto the current runtime.
        let _runtime = self.runtime.enter();
        let mut buf = vec![0u8; self.part_size];
        loop {
            let mut filled = 0;
            while filled < buf.len() {
                let n = file
                    .read(&mut buf[filled..])
                    .map_err(io_err("read", path))?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
            if filled == 0 {
                return Ok(true);
            }
            self.runtime
                .block_on(writer.wait_for_capacity(PARTS_IN_FLIGHT))
                .map_err(store_err("put part", key))?;
            writer.write(&buf[..filled]);
            if stop_mid {
                self.runtime
                    .block_on(writer.wait_for_capacity(0))
                    .map_err(store_err("put part", key))?;
                return Ok(false);
            }
        }
    }
}
