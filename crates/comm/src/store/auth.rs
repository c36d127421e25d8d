//! The job secret and the HMAC-SHA256 challenge-response that every store connection starts with.
//!
//! Handshake (all fixed-size, so no length field can be abused before authentication):
//!
//! | step | direction | bytes |
//! |---|---|---|
//! | 1 | server → client | [`GREETING_MAGIC`] (8) ‖ server nonce (32) |
//! | 2 | client → server | client nonce (32) ‖ `HMAC(secret, CLIENT_LABEL ‖ server_nonce ‖ client_nonce)` (32) |
//! | 3 | server → client | [`ACCEPTED`] ‖ `HMAC(secret, SERVER_LABEL ‖ client_nonce ‖ server_nonce)` (32), or [`REFUSED`] and close |
//!
//! The client's proof shows it holds the secret; the server's proof (a different label, so one
//! side's proof can never be replayed as the other's) shows the server holds it too. Tags are
//! compared in constant time. [`hmac_sha256`] and [`verify_hmac_sha256`] are public because the
//! transport layer reuses them for its connection hellos.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{CommError, Result};

/// Environment variable holding the job secret itself.
pub const SECRET_ENV: &str = "FLOTILLA_SECRET";
/// Environment variable holding the path of a file whose (trimmed) contents are the job secret.
pub const SECRET_FILE_ENV: &str = "FLOTILLA_SECRET_FILE";
/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Largest job secret file read (64 KiB), checked before reading.
pub const MAX_SECRET_FILE_BYTES: u64 = 64 << 10;
/// Length of an HMAC-SHA256 tag.
pub const TAG_LEN: usize = 32;
/// First 8 bytes a store server sends; names the protocol and its version.
pub const GREETING_MAGIC: [u8; 8] = *b"FLSTORE1";
/// Domain-separation label of the client's proof.
pub const CLIENT_LABEL: &[u8] = b"flotilla-store-v1";
/// Domain-separation label of the server's proof.
pub const SERVER_LABEL: &[u8] = b"flotilla-store-v1-server";
/// Handshake status byte: the client's proof was accepted (the server's proof follows).
pub const ACCEPTED: u8 = 0;
/// Handshake status byte: the client's proof was refused (the server then closes).
pub const REFUSED: u8 = 1;
/// Length of the server's greeting.
pub const GREETING_LEN: usize = GREETING_MAGIC.len() + NONCE_LEN;
/// Length of the client's answer.
pub const ANSWER_LEN: usize = NONCE_LEN + TAG_LEN;

/// Number of random bytes behind a [`Secret::generate`]d secret.
const GENERATED_BYTES: usize = 32;

/// The job secret shared by the launcher, the store and every rank.
///
/// Its bytes are exactly the text of `FLOTILLA_SECRET` (surrounding whitespace removed), so a
/// secret round-trips through the environment or a file. `Debug` never shows it.
#[derive(Clone)]
pub struct Secret {
    bytes: Vec<u8>,
}

impl Secret {
    /// A secret made of `bytes` (must not be empty).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(CommError::InvalidArgument(
                "the job secret must not be empty".into(),
            ));
        }
        Ok(Secret { bytes })
    }

    /// A fresh secret: 32 bytes from the OS random source, hex-encoded (64 ASCII characters).
    pub fn generate() -> Result<Secret> {
        let mut raw = [0u8; GENERATED_BYTES];
        fill_random(&mut raw)?;
        let hex = to_hex(&raw);
        raw.fill(0);
        Secret::new(hex.into_bytes())
    }

    /// Reads the secret from `FLOTILLA_SECRET`, or else from the file named by
    /// `FLOTILLA_SECRET_FILE`; `Ok(None)` if neither is set. Setting both, an empty secret or an
    /// unreadable file is a [`CommError::Config`] / [`CommError::Io`] error.
    pub fn from_env() -> Result<Option<Secret>> {
        Secret::from_lookup(|name| std::env::var_os(name))
    }

    /// Like [`Secret::from_env`], but a missing secret is a [`CommError::Config`] error.
    pub fn from_env_required() -> Result<Secret> {
        Secret::from_env()?.ok_or_else(|| {
            CommError::Config(format!(
                "no job secret: set {SECRET_ENV} or {SECRET_FILE_ENV} (e.g. from Secret::generate)"
            ))
        })
    }

    /// [`Secret::from_env`] over an arbitrary variable lookup (testable without touching the
    /// process environment).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Option<Secret>> {
        match (lookup(SECRET_ENV), lookup(SECRET_FILE_ENV)) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => Err(CommError::Config(format!(
                "both {SECRET_ENV} and {SECRET_FILE_ENV} are set; set only one"
            ))),
            (Some(value), None) => {
                let secret = value.as_bytes().trim_ascii();
                if secret.is_empty() {
                    return Err(CommError::Config(format!("{SECRET_ENV} is set but empty")));
                }
                Ok(Some(Secret {
                    bytes: secret.to_vec(),
                }))
            }
            (None, Some(path)) => Secret::from_file(Path::new(&path)).map(Some),
        }
    }

    /// Reads a secret from a file (contents trimmed of surrounding whitespace): a regular file
    /// of at most [`MAX_SECRET_FILE_BYTES`].
    pub fn from_file(path: &Path) -> Result<Secret> {
        // A regular file of at most MAX_SECRET_FILE_BYTES: a FIFO or a link to a device (or
        // to a large file) is refused, not read until memory runs out.
        let mut contents = fsread::read_bounded(path, MAX_SECRET_FILE_BYTES, fsread::Links::Follow)
            .map_err(|e| match e {
                fsread::ReadError::Io { source, .. } => CommError::io(
                    format!("reading the job secret file {}", path.display()),
                    source,
                ),
                refused => CommError::Config(format!("the job secret file: {refused}")),
            })?;
        warn_if_readable_by_others(path);
        let secret = contents.trim_ascii().to_vec();
        contents.fill(0);
        if secret.is_empty() {
            return Err(CommError::Config(format!(
                "the job secret file {} is empty",
                path.display()
            )));
        }
        Ok(Secret { bytes: secret })
    }

    /// The secret as a value for `FLOTILLA_SECRET` (or a secret file). Fails for secrets that would
    /// not read back identically: not UTF-8, containing NUL, or with surrounding whitespace.
    /// Secrets from [`Secret::generate`] always succeed.
    pub fn to_env_value(&self) -> Result<String> {
        let text = std::str::from_utf8(&self.bytes).map_err(|_| {
            CommError::Config(
                "the job secret is not UTF-8 text; it cannot be put in the environment".into(),
            )
        })?;
        if text.contains('\0') || text.trim_ascii() != text {
            return Err(CommError::Config(
                "the job secret contains NUL or surrounding whitespace; it would not read back from the environment"
                    .into(),
            ));
        }
        Ok(text.to_owned())
    }

    /// The secret's bytes (the HMAC key).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<redacted, {} bytes>)", self.bytes.len())
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        for b in self.bytes.iter_mut() {
            // SAFETY: `b` is a valid, exclusive reference into our own buffer; the volatile write
            // only keeps the compiler from eliding the wipe of a buffer about to be freed.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return;
    };
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            "job secret file {} is accessible by group/others (mode {:o}); consider chmod 600",
            path.display(),
            meta.permissions().mode() & 0o777
        );
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_path: &Path) {}

fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

/// Fills `buf` from the OS random source.
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    getrandom::getrandom(buf).map_err(|e| {
        CommError::io(
            "reading the OS random source",
            std::io::Error::other(e.to_string()),
        )
    })
}

/// A fresh random handshake nonce.
pub fn random_nonce() -> Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    fill_random(&mut nonce)?;
    Ok(nonce)
}

fn mac_over(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length (long keys are hashed), so this cannot fail.
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for part in parts {
        mac.update(part);
    }
    mac
}

/// HMAC-SHA256 of the concatenation of `parts` under `key`.
pub fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; TAG_LEN] {
    mac_over(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the HMAC-SHA256 of `parts` under `key`, compared in constant time.
pub fn verify_hmac_sha256(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    mac_over(key, parts).verify_slice(tag).is_ok()
}

/// The client's proof: `HMAC(secret, CLIENT_LABEL ‖ server_nonce ‖ client_nonce)`.
pub fn client_proof(secret: &Secret, server_nonce: &[u8], client_nonce: &[u8]) -> [u8; TAG_LEN] {
    hmac_sha256(
        secret.as_bytes(),
        &[CLIENT_LABEL, server_nonce, client_nonce],
    )
}

/// The server's proof: `HMAC(secret, SERVER_LABEL ‖ client_nonce ‖ server_nonce)`.
pub fn server_proof(secret: &Secret, client_nonce: &[u8], server_nonce: &[u8]) -> [u8; TAG_LEN] {
    hmac_sha256(
        secret.as_bytes(),
        &[SERVER_LABEL, client_nonce, server_nonce],
    )
}

/// Runs the server side of the handshake. The caller sets the stream's read timeout first, so a
/// silent client cannot hold the connection. On a bad proof, sends [`REFUSED`] and returns
/// [`CommError::Auth`]; the caller must then drop the connection without reading further.
pub fn server_handshake<S: Read + Write>(stream: &mut S, secret: &Secret) -> Result<()> {
    let server_nonce = random_nonce()?;
    let mut greeting = [0u8; GREETING_LEN];
    greeting[..GREETING_MAGIC.len()].copy_from_slice(&GREETING_MAGIC);
    greeting[GREETING_MAGIC.len()..].copy_from_slice(&server_nonce);
    stream
        .write_all(&greeting)
        .map_err(|e| CommError::io("sending the store greeting", e))?;

    let mut answer = [0u8; ANSWER_LEN];
    stream
        .read_exact(&mut answer)
        .map_err(|e| CommError::io("reading the client's handshake answer", e))?;
    let (client_nonce, proof) = answer.split_at(NONCE_LEN);
    let parts: [&[u8]; 3] = [CLIENT_LABEL, &server_nonce, client_nonce];
    if !verify_hmac_sha256(secret.as_bytes(), &parts, proof) {
        let _ = stream.write_all(&[REFUSED]);
        return Err(CommError::Auth(
            "the client's proof does not match the job secret".into(),
        ));
    }
    let mut reply = [0u8; 1 + TAG_LEN];
    reply[0] = ACCEPTED;
    reply[1..].copy_from_slice(&server_proof(secret, client_nonce, &server_nonce));
    stream
        .write_all(&reply)
        .map_err(|e| CommError::io("sending the store's handshake proof", e))
}

/// Runs the client side of the handshake: answers the server's challenge and checks the server's
/// own proof. The caller sets the stream's timeouts first.
pub fn client_handshake<S: Read + Write>(stream: &mut S, secret: &Secret) -> Result<()> {
    let mut greeting = [0u8; GREETING_LEN];
    stream
        .read_exact(&mut greeting)
        .map_err(|e| CommError::io("reading the store greeting", e))?;
    let (magic, server_nonce) = greeting.split_at(GREETING_MAGIC.len());
    if magic != GREETING_MAGIC {
        return Err(CommError::Store(
            "the peer is not a flotilla store (or speaks another protocol version): bad greeting"
                .into(),
        ));
    }
    let client_nonce = random_nonce()?;
    let mut answer = [0u8; ANSWER_LEN];
    answer[..NONCE_LEN].copy_from_slice(&client_nonce);
    answer[NONCE_LEN..].copy_from_slice(&client_proof(secret, server_nonce, &client_nonce));
    stream
        .write_all(&answer)
        .map_err(|e| CommError::io("sending the handshake answer to the store", e))?;

    let mut status = [0u8; 1];
    stream
        .read_exact(&mut status)
        .map_err(|e| CommError::io("reading the store's handshake verdict", e))?;
    match status[0] {
        ACCEPTED => {}
        REFUSED => {
            return Err(CommError::Auth(format!(
                "the store refused our proof: the job secrets differ (check {SECRET_ENV} / {SECRET_FILE_ENV})"
            )));
        }
        other => {
            return Err(CommError::Store(format!(
                "unexpected handshake status byte {other} from the store"
            )));
        }
    }
    let mut proof = [0u8; TAG_LEN];
    stream
        .read_exact(&mut proof)
        .map_err(|e| CommError::io("reading the store's handshake proof", e))?;
    let parts: [&[u8]; 3] = [SERVER_LABEL, &client_nonce, server_nonce];
    if !verify_hmac_sha256(secret.as_bytes(), &parts, &proof) {
        return Err(CommError::Auth(
            "the store failed to prove it holds the job secret".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        let tag = hmac_sha256(b"Jefe", &[b"what do ya ", b"want for nothing?"]);
        assert_eq!(
            to_hex(&tag),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert!(verify_hmac_sha256(
            b"Jefe",
            &[b"what do ya want for nothing?"],
            &tag
        ));
        let mut bad = tag;
        bad[31] ^= 1;
        assert!(!verify_hmac_sha256(
            b"Jefe",
            &[b"what do ya want for nothing?"],
            &bad
        ));
        assert!(!verify_hmac_sha256(b"Jefe", &[b"x"], &tag[..16]));
    }

    #[test]
    fn debug_is_redacted() {
        let s = Secret::new(b"hunter2-very-secret".to_vec()).unwrap();
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("redacted"));
    }

    #[test]
    fn generated_secret_round_trips_through_env_value() {
        let s = Secret::generate().unwrap();
        assert_eq!(s.as_bytes().len(), 64);
        let value = s.to_env_value().unwrap();
        let back = Secret::from_lookup(lookup(&[(SECRET_ENV, &value)]))
            .unwrap()
            .unwrap();
        assert_eq!(back.as_bytes(), s.as_bytes());
        assert_ne!(Secret::generate().unwrap().as_bytes(), s.as_bytes());
    }

    #[test]
    fn env_lookup_rules() {
        assert!(Secret::from_lookup(lookup(&[])).unwrap().is_none());
        let s = Secret::from_lookup(lookup(&[(SECRET_ENV, "  abc \n")]))
            .unwrap()
            .unwrap();
        assert_eq!(s.as_bytes(), b"abc");
        assert!(matches!(
            Secret::from_lookup(lookup(&[(SECRET_ENV, "  ")])),
            Err(CommError::Config(_))
        ));
        assert!(matches!(
            Secret::from_lookup(lookup(&[(SECRET_ENV, "a"), (SECRET_FILE_ENV, "/x")])),
            Err(CommError::Config(_))
        ));
        assert!(matches!(
            Secret::from_lookup(lookup(&[(SECRET_FILE_ENV, "/nonexistent/flotilla/secret")])),
            Err(CommError::Io { .. })
        ));
        assert!(Secret::new(Vec::new()).is_err());
        assert!(Secret::new(b" x".to_vec()).unwrap().to_env_value().is_err());
        assert!(
            Secret::new(vec![0xff, 0xfe])
                .unwrap()
                .to_env_value()
                .is_err()
        );
    }

    #[test]
    fn secret_file_is_trimmed() {
        let path =
            std::env::temp_dir().join(format!("flotilla-secret-test-{}", std::process::id()));
        std::fs::write(&path, b"file-secret\n").unwrap();
        let s = Secret::from_lookup(lookup(&[(SECRET_FILE_ENV, path.to_str().unwrap())]))
            .unwrap()
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(s.as_bytes(), b"file-secret");
    }

    #[test]
    fn proofs_are_domain_separated() {
        let s = Secret::new(b"k".to_vec()).unwrap();
        let (a, b) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        // The server's proof over (a, b) is not the client's proof over (b, a) or (a, b).
        assert_ne!(server_proof(&s, &a, &b), client_proof(&s, &b, &a));
        assert_ne!(server_proof(&s, &a, &b), client_proof(&s, &a, &b));
    }
}
