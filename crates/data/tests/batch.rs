//! Batch sampling and id validation.

use data::{DataError, TokenWindows, validate_ids};

fn ramp(n: u32) -> Vec<u32> {
    (0..n).collect()
}

fn batch(w: &mut TokenWindows, b: usize) -> (Vec<u32>, Vec<u32>) {
    let t = w.seq_len();
    let (mut x, mut y) = (vec![0; b * t], vec![0; b * t]);
    w.next_batch(b, &mut x, &mut y).unwrap();
    (x, y)
}

#[test]
fn targets_are_inputs_shifted_by_one() {
    let mut w = TokenWindows::new(ramp(1000), 16, 3).unwrap();
    for _ in 0..20 {
        let (x, y) = batch(&mut w, 4);
        for (xr, yr) in x.chunks(16).zip(y.chunks(16)) {
            // On a ramp each row is consecutive and each target is its input plus one.
            assert!(xr.windows(2).all(|p| p[1] == p[0] + 1), "{xr:?}");
            assert!(xr.iter().zip(yr).all(|(a, b)| *b == a + 1));
            assert_eq!(&xr[1..], &yr[..15]);
        }
    }
}

#[test]
fn same_seed_same_batches() {
    let mut a = TokenWindows::new(ramp(5000), 8, 9).unwrap();
    let mut b = TokenWindows::new(ramp(5000), 8, 9).unwrap();
    let mut c = TokenWindows::new(ramp(5000), 8, 10).unwrap();
    let (mut same, mut diff) = (true, false);
    for _ in 0..5 {
        let (ba, bb, bc) = (batch(&mut a, 3), batch(&mut b, 3), batch(&mut c, 3));
        same &= ba == bb;
        diff |= ba != bc;
    }
    assert!(same && diff);
}

#[test]
fn every_start_is_reachable_including_the_last() {
    // 6 tokens, T = 4: a window is 5 tokens, so starts 0 and 1 only.
    let mut w = TokenWindows::new(ramp(6), 4, 0).unwrap();
    let mut seen = [false; 2];
    for _ in 0..100 {
        let (x, y) = batch(&mut w, 1);
        seen[x[0] as usize] = true;
        assert!(*y.last().unwrap() <= 5);
    }
    assert_eq!(seen, [true, true]);
}

#[test]
fn short_buffer_and_zero_seq_len_are_errors() {
    let err = TokenWindows::new(ramp(8), 8, 0).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::BufferTooShort {
                len: 8,
                seq_len: 8,
                needed: 9
            }
        ),
        "{err}"
    );
    let err = TokenWindows::new(ramp(8), 0, 0).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::InvalidArgument {
                field: "seq_len",
                ..
            }
        ),
        "{err}"
    );
    assert!(TokenWindows::new(ramp(9), 8, 0).is_ok());
}

#[test]
fn wrong_slice_lengths_name_the_field() {
    let mut w = TokenWindows::new(ramp(100), 4, 0).unwrap();
    let (mut x, mut y) = (vec![0; 8], vec![0; 8]);
    let err = w.next_batch(2, &mut x[..7], &mut y).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SliceLength {
                field: "inputs",
                got: 7,
                expected: 8,
                ..
            }
        ),
        "{err}"
    );
    let err = w.next_batch(2, &mut x, &mut y[..6]).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SliceLength {
                field: "targets",
                got: 6,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("targets"), "{err}");
    let err = w.next_batch(usize::MAX, &mut x, &mut y).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SliceLength {
                field: "inputs",
                ..
            }
        ),
        "{err}"
    );
    let empty: &mut [u32] = &mut [];
    w.next_batch(0, empty, &mut []).unwrap();
}

#[test]
fn validate_ids_names_first_bad_id_and_position() {
    assert!(validate_ids(&[0, 5, 9], 10).is_ok());
    let err = validate_ids(&[0, 5, 12, 10], 10).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                id: 12,
                position: 2,
                vocab: 10
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("12") && err.to_string().contains("position 2"),
        "{err}"
    );
}
