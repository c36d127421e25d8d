use super::*;

/// The error of reading `path` with a 1 KiB cap, which must come back within 10 s.
fn refused(path: &Path, links: Links) -> ReadError {
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = path.to_path_buf();
    std::thread::spawn(move || tx.send(read_bounded(&owned, 1024, links)));
    match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(Err(e)) => e,
        Ok(Ok(bytes)) => panic!("{} read: {} bytes", path.display(), bytes.len()),
        Err(_) => panic!("reading {} hung", path.display()),
    }
}

fn assert_not_a_file(path: &Path, what: &str) {
    let err = refused(path, Links::Follow);
    assert!(
        matches!(&err, ReadError::NotAFile { kind, .. } if kind.contains(what)),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains(what),
        "{msg}"
    );
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("manifest.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert_not_a_file(&fifo, "FIFO");
}

#[test]
fn a_link_to_dev_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("manifest.json");
    std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
    assert_not_a_file(&link, "character device");
}

#[test]
fn a_link_is_refused_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("real.json");
    std::fs::write(&target, b"{}").unwrap();
    let link = dir.path().join("manifest.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    assert_eq!(read_bounded(&link, 1024, Links::Follow).unwrap(), b"{}");
    assert!(matches!(
        refused(&link, Links::Refuse),
        ReadError::Symlink { .. }
    ));
}

#[test]
fn a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    assert_not_a_file(dir.path(), "directory");
}

#[test]
fn an_oversized_file_is_refused_before_reading() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.json");
    // Sparse: 1 TiB claimed, nothing allocated; reading it would take forever.
    File::create(&path).unwrap().set_len(1 << 40).unwrap();
    let err = refused(&path, Links::Follow);
    assert!(
        matches!(err, ReadError::TooLarge { size, cap: 1024, .. } if size == 1 << 40),
        "{err}"
    );
    assert!(err.to_string().contains("big.json") && err.to_string().contains("1024"));
}

#[test]
fn a_file_at_the_cap_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ok.json");
    std::fs::write(&path, vec![b'x'; 1024]).unwrap();
    assert_eq!(
        read_bounded(&path, 1024, Links::Follow).unwrap().len(),
        1024
    );
    assert!(matches!(
        read_bounded(&path, 1023, Links::Follow),
        Err(ReadError::TooLarge { size: 1024, .. })
    ));
}

#[test]
fn text_must_be_utf8() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, b"a = 1\n\xff").unwrap();
    let err = read_text_bounded(&path, 1024, Links::Follow).unwrap_err();
    assert!(matches!(err, ReadError::NotText { at: 6, .. }), "{err}");
    std::fs::write(&path, b"a = 1\n").unwrap();
    assert_eq!(
        read_text_bounded(&path, 1024, Links::Follow).unwrap(),
        "a = 1\n"
    );
}
