//! The remotes the scenarios run against: a moto S3 server started per test
//! (`objstore::test_server`), or a `file://` directory.
use ckpt::remote::{RemoteOptions, RemoteStore};
use objstore::test_server::{BUCKET, S3Server};

/// A remote to test against: a moto bucket or a directory; each test uses its own prefixes.
pub(crate) struct Remote {
    base: String,
    opts: RemoteOptions,
    _server: Option<S3Server>,
    _dir: Option<tempfile::TempDir>,
}

impl Remote {
    pub(crate) fn s3() -> Remote {
        let server = S3Server::start();
        let opts = RemoteOptions {
            multipart_threshold: small_parts().multipart_threshold,
            part_size: small_parts().part_size,
            ..server.options()
        };
        Remote {
            base: format!("s3://{BUCKET}"),
            opts,
            _server: Some(server),
            _dir: None,
        }
    }

    pub(crate) fn file() -> Remote {
        let dir = tempfile::tempdir().unwrap();
        Remote {
            base: format!("file://{}", dir.path().display()),
            opts: small_parts(),
            _server: None,
            _dir: Some(dir),
        }
    }

    pub(crate) fn store(&self, prefix: &str) -> RemoteStore {
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
