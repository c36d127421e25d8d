//! A real local S3-compatible server for tests (feature `test-server`): moto, on a free
//! loopback port, with one bucket, killed on drop.
//!
//! The server binary is `FLOTILLA_S3_SERVER`, else `moto_server` on `PATH`. When there is none
//! the test fails with instructions: S3 tests never pass silently (`.ci/run` installs moto into
//! /opt/flotilla-s3).
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::RemoteOptions;

/// The bucket every test server holds.
pub const BUCKET: &str = "flotilla";

/// A moto S3 server on a free loopback port, killed on drop.
pub struct S3Server {
    child: Child,
    endpoint: String,
    _log_dir: tempfile::TempDir,
}

/// The moto server binary: `FLOTILLA_S3_SERVER`, else `moto_server` on `PATH`; panics with
/// instructions when there is none.
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
    /// Starts the server and creates [`BUCKET`]; panics if it does not answer within 60 s.
    pub fn start() -> S3Server {
        let bin = find_server();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let log_dir = tempfile::tempdir().expect("moto log directory");
        let log = log_dir.path().join("moto.log");
        let child = Command::new(&bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("moto log"))
            .stderr(std::fs::File::create(log.with_extension("err")).expect("moto log"))
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

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Options that reach the server (test credentials, plain HTTP, 20 s of retries).
    pub fn options(&self) -> RemoteOptions {
        RemoteOptions {
            endpoint: Some(self.endpoint.clone()),
            region: Some("us-east-1".into()),
            access_key_id: Some("test".into()),
            secret_access_key: Some("test".into()),
            allow_http: Some(true),
            retry_timeout: Some(Duration::from_secs(20)),
            ..RemoteOptions::default()
        }
    }

    /// The `AWS_*` variables a child process (`flotilla ...`) needs to reach the server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_DEFAULT_REGION", "us-east-1".into()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// Waits (at most 60 s) until the server answers, then creates the test bucket.
    fn wait_ready(&mut self, port: u16, log: &Path) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().expect("moto status") {
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

/// Sends `PUT /<BUCKET>` (create bucket); `None` while nothing listens yet.
fn put_bucket(port: u16) -> Option<String> {
    let addr = ([127, 0, 0, 1], port).into();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let req = format!(
        "PUT /{BUCKET} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
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
