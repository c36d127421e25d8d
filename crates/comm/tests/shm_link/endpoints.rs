//! Domains and endpoints: bad endpoints and creation arguments are errors, and unlinking or
//! dropping a domain removes its files without breaking its links.
use comm::transport::Link;
use comm::transport::shm::{ShmDomain, ShmEndpoint};

use super::{TempDir, pair};

// ---------------------------------------------------------------------------------------------
// (3) Bad endpoints and arguments
// ---------------------------------------------------------------------------------------------

fn connect_err(d: &ShmDomain, ep: &ShmEndpoint) -> std::io::Error {
    d.connect(ep).expect_err("connect must fail")
}

#[test]
fn shm_bad_endpoints_are_errors() {
    use std::io::ErrorKind::{AlreadyExists, InvalidData, InvalidInput, NotFound};
    let dir = TempDir::new("bad");
    let p = dir.path();
    let d0 = ShmDomain::create(p, "bad", 0, &[1, 2], 4096).unwrap();
    let d1 = ShmDomain::create(p, "bad", 1, &[0], 4096).unwrap();
    let good = d1.endpoint().clone();

    // The endpoint survives the store's JSON round trip.
    let json = serde_json::to_string(&good).unwrap();
    assert_eq!(serde_json::from_str::<ShmEndpoint>(&json).unwrap(), good);

    let mut ep = good.clone();
    ep.segment = p.join("missing");
    assert_eq!(connect_err(&d0, &ep).kind(), NotFound);
    let mut ep = good.clone();
    ep.doorbell = p.join("missing.bell");
    assert_eq!(connect_err(&d0, &ep).kind(), NotFound);
    let mut ep = good.clone();
    ep.doorbell = good.segment.clone(); // a regular file is no doorbell
    assert_eq!(connect_err(&d0, &ep).kind(), InvalidData);
    let mut ep = good.clone();
    ep.peers = vec![5];
    assert_eq!(
        connect_err(&d0, &ep).kind(),
        InvalidData,
        "my rank not in its list"
    );
    let mut ep = good.clone();
    ep.peers = vec![0, 0];
    assert_eq!(
        connect_err(&d0, &ep).kind(),
        InvalidData,
        "list disagrees with file size"
    );
    let mut ep = good.clone();
    ep.nonce ^= 1;
    assert_eq!(connect_err(&d0, &ep).kind(), InvalidData, "stale nonce");
    for bytes in [0, 100, 8192, usize::MAX] {
        let mut ep = good.clone();
        ep.ring_bytes = bytes;
        assert_eq!(
            connect_err(&d0, &ep).kind(),
            InvalidData,
            "ring_bytes {bytes}"
        );
    }
    let mut ep = good.clone();
    ep.rank = 0;
    assert_eq!(
        connect_err(&d0, &ep).kind(),
        InvalidInput,
        "rank 0 is not its own peer"
    );
    let mut ep = good.clone();
    ep.rank = 2; // a local peer of rank 0, but the segment belongs to rank 1
    assert_eq!(connect_err(&d0, &ep).kind(), InvalidData);
    let mut ep = good.clone();
    ep.pid = i32::MAX as u32 - 7; // no such process
    assert!(d0.connect(&ep).is_err());

    // Emptied file, then wrong magic.
    let d3 = ShmDomain::create(p, "magic", 1, &[0], 4096).unwrap();
    std::fs::write(&d3.endpoint().segment, []).ok(); // truncates to zero: size mismatch
    let d0b = ShmDomain::create(p, "magic", 0, &[1], 4096).unwrap();
    assert_eq!(
        connect_err(&d0b, d3.endpoint()).kind(),
        InvalidData,
        "truncated to zero"
    );
    let d4 = ShmDomain::create(p, "magic2", 1, &[0], 4096).unwrap();
    let d0c = ShmDomain::create(p, "magic2", 0, &[1], 4096).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&d4.endpoint().segment)
            .unwrap();
        f.write_all_at(b"NOTMAGIC", 0).unwrap();
    }
    assert_eq!(
        connect_err(&d0c, d4.endpoint()).kind(),
        InvalidData,
        "wrong magic"
    );

    // Truncated file.
    let d5 = ShmDomain::create(p, "trunc", 1, &[0], 4096).unwrap();
    let d0d = ShmDomain::create(p, "trunc", 0, &[1], 4096).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&d5.endpoint().segment)
        .unwrap();
    f.set_len(1000).unwrap();
    assert_eq!(
        connect_err(&d0d, d5.endpoint()).kind(),
        InvalidData,
        "truncated"
    );

    // Good endpoint connects once; a second link on the same SPSC ring is refused.
    let _link = d0.connect(&good).expect("good endpoint");
    assert_eq!(connect_err(&d0, &good).kind(), AlreadyExists);

    // Bad creation arguments; names are never reused.
    assert_eq!(
        ShmDomain::create(p, "x", 0, &[1], 100).unwrap_err().kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "x", 0, &[0], 4096).unwrap_err().kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "x", 0, &[1, 1], 4096)
            .unwrap_err()
            .kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "a/b", 0, &[1], 4096)
            .unwrap_err()
            .kind(),
        InvalidInput
    );
    assert_eq!(
        ShmDomain::create(p, "bad", 1, &[0], 4096)
            .unwrap_err()
            .kind(),
        AlreadyExists
    );
}

#[test]
fn shm_unlink_keeps_links_working() {
    let dir = TempDir::new("unlink");
    let (d0, d1, mut l01, mut l10) = pair(dir.path(), 4096);
    d0.unlink_files().unwrap();
    d1.unlink_files().unwrap();
    d1.unlink_files().unwrap(); // idempotent
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "files left behind"
    );
    assert_eq!(l01.try_send(b"hello").unwrap(), 5);
    let mut buf = [0u8; 8];
    assert_eq!(l10.try_recv_into(&mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    // Dropping the domains first must not invalidate the links either.
    drop((d0, d1));
    assert_eq!(l10.try_send(b"back").unwrap(), 4);
    assert_eq!(l01.try_recv_into(&mut buf).unwrap(), 4);
    assert_eq!(&buf[..4], b"back");
}

#[test]
fn shm_domain_drop_removes_files() {
    let dir = TempDir::new("drop");
    let d = ShmDomain::create(dir.path(), "gone", 3, &[0, 1, 2], 4096).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    drop(d);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
