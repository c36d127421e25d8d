//! The wire header that precedes every message between two ranks.
//!
//! Layout (64 bytes, little endian):
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 4 | magic `FLTB` |
//! | 4 | 1 | version |
//! | 5 | 1 | frame type ([`FrameType`]) |
//! | 6 | 1 | op kind ([`OpKind`]) |
//! | 7 | 1 | dtype ([`DType`] tag) |
//! | 8 | 8 | group id |
//! | 16 | 8 | generation |
//! | 24 | 8 | op sequence number |
//! | 32 | 8 | op signature (element count of the whole call) |
//! | 40 | 8 | payload length in bytes |
//! | 48 | 4 | sender rank (in the group) |
//! | 52 | 4 | algorithm step |
//! | 56 | 4 | reserved, zero |
//! | 60 | 4 | FNV-1a checksum of bytes 0..60 |
//!
//! The receiver always knows how many bytes it expects, so a length field is checked against that
//! expectation (and against [`MAX_PAYLOAD`]) before a single payload byte is read: a hostile or
//! corrupted length can never size an allocation.

use crate::dtype::DType;

/// Size of an encoded header.
pub const HEADER_LEN: usize = 64;
/// Magic at the start of every frame.
pub const MAGIC: [u8; 4] = *b"FLTB";
/// Wire version.
pub const VERSION: u8 = 1;
/// Largest payload any single message may carry (1 TiB); anything larger is malformed.
pub const MAX_PAYLOAD: u64 = 1 << 40;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// Payload of a collective or point-to-point op.
    Data = 1,
    /// First frame on a new connection (identifies the sender).
    Hello = 2,
}

/// Collective operation kinds, as carried on the wire and in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Reduce = 5,
    AllToAll = 6,
    Barrier = 7,
    SendRecv = 8,
    Calibrate = 9,
    Connect = 10,
}

impl OpKind {
    /// Every kind.
    pub const ALL: [OpKind; 10] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::SendRecv,
        OpKind::Calibrate,
        OpKind::Connect,
    ];

    /// snake_case name.
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::SendRecv => "send_recv",
            OpKind::Calibrate => "calibrate",
            OpKind::Connect => "connect",
        }
    }

    fn from_u8(v: u8) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|k| *k as u8 == v)
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub frame_type: FrameType,
    pub kind: OpKind,
    pub dtype: DType,
    pub group_id: u64,
    pub generation: u64,
    pub seq: u64,
    pub signature: u64,
    pub payload_len: u64,
    pub sender: u32,
    pub step: u32,
}

/// Why a header could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("truncated header: {0} of {HEADER_LEN} bytes")]
    Truncated(usize),
    #[error("bad magic {0:02x?} (not a Flotilla frame)")]
    BadMagic([u8; 4]),
    #[error("unsupported wire version {0} (this build speaks {VERSION})")]
    Version(u8),
    #[error("header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("unknown frame type {0}")]
    FrameType(u8),
    #[error("unknown op kind {0}")]
    OpKind(u8),
    #[error("unknown dtype tag {0}")]
    DType(u8),
    #[error("payload length {0} exceeds the largest legal message ({MAX_PAYLOAD} bytes)")]
    TooLarge(u64),
    #[error("reserved bytes are not zero")]
    Reserved,
}

/// FNV-1a, 32 bit: a cheap guard against corrupted or foreign headers.
fn fnv1a(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in bytes {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

impl FrameHeader {
    /// Encodes into exactly [`HEADER_LEN`] bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.frame_type as u8;
        b[6] = self.kind as u8;
        b[7] = self.dtype as u8;
        b[8..16].copy_from_slice(&self.group_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.generation.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.signature.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b[48..52].copy_from_slice(&self.sender.to_le_bytes());
        b[52..56].copy_from_slice(&self.step.to_le_bytes());
        let c = fnv1a(&b[0..60]);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decodes and checks a header; never panics, never allocates.
    pub fn decode(b: &[u8]) -> Result<FrameHeader, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(FrameError::Version(b[4]));
        }
        let stored = u32_at(60);
        let computed = fnv1a(&b[0..60]);
        if stored != computed {
            return Err(FrameError::Checksum { stored, computed });
        }
        let frame_type = match b[5] {
            1 => FrameType::Data,
            2 => FrameType::Hello,
            t => return Err(FrameError::FrameType(t)),
        };
        let kind = OpKind::from_u8(b[6]).ok_or(FrameError::OpKind(b[6]))?;
        let dtype = DType::from_u8(b[7]).ok_or(FrameError::DType(b[7]))?;
        if u32_at(56) != 0 {
            return Err(FrameError::Reserved);
        }
        let payload_len = u64_at(40);
        if payload_len > MAX_PAYLOAD {
            return Err(FrameError::TooLarge(payload_len));
        }
        Ok(FrameHeader {
            frame_type,
            kind,
            dtype,
            group_id: u64_at(8),
            generation: u64_at(16),
            seq: u64_at(24),
            signature: u64_at(32),
            payload_len,
            sender: u32_at(48),
            step: u32_at(52),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> FrameHeader {
        FrameHeader {
            frame_type: FrameType::Data,
            kind: OpKind::AllReduce,
            dtype: DType::BF16,
            group_id: 0xdead_beef,
            generation: 3,
            seq: 42,
            signature: 1000,
            payload_len: 4000,
            sender: 5,
            step: 2,
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn rejects_truncated_and_oversized() {
        let b = sample().encode();
        assert_eq!(
            FrameHeader::decode(&b[..10]),
            Err(FrameError::Truncated(10))
        );
        let mut h = sample();
        h.payload_len = u64::MAX;
        assert_eq!(
            FrameHeader::decode(&h.encode()),
            Err(FrameError::TooLarge(u64::MAX))
        );
    }

    #[test]
    fn rejects_foreign_bytes() {
        let mut b = [0u8; HEADER_LEN];
        b[..27].copy_from_slice(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::BadMagic(_))
        ));
    }

    proptest! {
        // The wire frame's fuzz target: a fixed budget for CI (well under a second).
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

        /// The decoder never panics on arbitrary bytes, and accepts only checksummed headers.
        #[test]
        fn decode_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..130)) {
            if let Ok(h) = FrameHeader::decode(&bytes) {
                prop_assert!(h.payload_len <= MAX_PAYLOAD);
                prop_assert_eq!(&h.encode()[..], &bytes[..HEADER_LEN]);
            }
        }

        /// Any single flipped bit of a valid header is detected.
        #[test]
        fn single_bit_flip_detected(bit in 0usize..(HEADER_LEN * 8)) {
            let mut b = sample().encode();
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(FrameHeader::decode(&b).is_err());
        }
    }
}
