//! Unit tests of [`super`] (kept apart to keep the module itself short).

use super::*;
use proptest::prelude::*;

fn body(frame: &[u8]) -> &[u8] {
    let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
    assert_eq!(len, frame.len() - 4);
    &frame[4..]
}

#[test]
fn requests_round_trip() {
    let ops = vec![
        Op::Set {
            key: "a",
            value: b"xyz",
        },
        Op::Get { key: "a/b" },
        Op::Wait {
            keys: vec!["k1", "k2"],
            timeout_ms: 1234,
        },
        Op::Add {
            key: "n",
            delta: -7,
        },
        Op::CompareSet {
            key: "c",
            expected: None,
            new: b"",
        },
        Op::CompareSet {
            key: "c",
            expected: Some(b"old"),
            new: b"new",
        },
        Op::Delete { key: "d" },
        Op::NumKeys,
        Op::Generation,
        Op::BumpGeneration { expected: 41 },
    ];
    for op in ops {
        let req = Request { generation: 9, op };
        let frame = encode_request(&req).unwrap();
        assert_eq!(decode_request(body(&frame)).unwrap(), req);
    }
}

#[test]
fn responses_round_trip() {
    let resps = vec![
        Response::Ok(Reply::Unit),
        Response::Ok(Reply::Value(None)),
        Response::Ok(Reply::Value(Some(b"v".to_vec()))),
        Response::Ok(Reply::Values(vec![b"a".to_vec(), Vec::new()])),
        Response::Ok(Reply::Int(-3)),
        Response::Ok(Reply::U64(u64::MAX)),
        Response::Ok(Reply::Bool(true)),
        Response::GenerationMismatch { got: 1, current: 2 },
        Response::WaitTimeout {
            missing: vec!["x".into()],
        },
        Response::Error("nope".into()),
    ];
    for resp in resps {
        let frame = encode_response(&resp);
        assert_eq!(decode_response(body(&frame)).unwrap(), resp);
    }
}

#[test]
fn encoder_enforces_limits() {
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    let req = Request {
        generation: 0,
        op: Op::Get { key: &long_key },
    };
    assert!(matches!(
        encode_request(&req),
        Err(CommError::InvalidArgument(_))
    ));
    let req = Request {
        generation: 0,
        op: Op::Get { key: "" },
    };
    assert!(matches!(
        encode_request(&req),
        Err(CommError::InvalidArgument(_))
    ));
    let big = vec![0u8; MAX_VALUE_LEN];
    let req = Request {
        generation: 0,
        op: Op::CompareSet {
            key: "k",
            expected: Some(&big),
            new: &big,
        },
    };
    assert!(matches!(
        encode_request(&req),
        Err(CommError::InvalidArgument(_))
    ));
}

#[test]
fn hostile_lengths_are_rejected() {
    // A SET whose value length claims u32::MAX.
    let mut b = vec![OP_SET];
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    b.push(b'k');
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode_request(&b).is_err());
    // A WAIT claiming more keys than bytes.
    let mut b = vec![OP_WAIT];
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1000u32.to_le_bytes());
    assert!(decode_request(&b).is_err());
    // A frame whose length field is u32::MAX.
    let mut r: &[u8] = &[0xff; 16];
    assert!(read_frame(&mut r, MAX_FRAME_LEN).is_err());
    // A truncated frame.
    let mut r: &[u8] = &[10, 0, 0, 0, 1, 2];
    assert!(read_frame(&mut r, MAX_FRAME_LEN).is_err());
    let mut r: &[u8] = &[10, 0];
    assert!(read_frame(&mut r, MAX_FRAME_LEN).is_err());
    let mut r: &[u8] = &[];
    assert!(read_frame(&mut r, MAX_FRAME_LEN).unwrap().is_none());
}

proptest! {
    // The store protocol's fuzz target: a fixed budget for CI (about a second).
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn decode_request_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_request(&bytes);
        let _ = decode_response(&bytes);
    }

    #[test]
    fn decode_request_with_valid_header_never_panics(
        op in 0u8..12,
        rest in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut b = vec![op];
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&rest);
        if let Ok(req) = decode_request(&b) {
            // Whatever decodes re-encodes to the same bytes.
            let frame = encode_request(&req).unwrap();
            prop_assert_eq!(&frame[4..], &b[..]);
        }
    }

    #[test]
    fn read_frame_allocates_only_what_arrives(
        len in any::<u32>(),
        rest in proptest::collection::vec(any::<u8>(), 0..4096),
    ) {
        let mut input = len.to_le_bytes().to_vec();
        input.extend_from_slice(&rest);
        let mut r: &[u8] = &input;
        match read_frame(&mut r, MAX_FRAME_LEN) {
            Ok(Some(body)) => {
                prop_assert_eq!(body.len(), len as usize);
                prop_assert!(body.capacity() <= 2 * input.len() + READ_CHUNK);
            }
            Ok(None) => prop_assert!(false, "input was not empty"),
            Err(_) => prop_assert!(len as usize > rest.len()),
        }
    }
}

#[test]
fn read_frame_grows_with_the_data() {
    // Claims 60 MiB (under the limit) but sends 10 bytes: must fail without a 60 MiB buffer.
    struct Counting<'a>(&'a [u8], usize);
    impl Read for Counting<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.1 = self.1.max(buf.len());
            self.0.read(buf)
        }
    }
    let mut input = (60u32 << 20).to_le_bytes().to_vec();
    input.extend_from_slice(&[7; 10]);
    let mut r = Counting(&input, 0);
    assert!(read_frame(&mut r, MAX_FRAME_LEN).is_err());
    assert!(r.1 <= READ_CHUNK, "asked for {} bytes at once", r.1);
}
