//! Agreement at admission (issue 29): every agent registers for a generation with its run
//! configuration (model, layout, hyperparameters, data, code version: named fields the
//! worker command describes) and an identity of its own. Node 0 compares each registration
//! with its own before it admits anyone, so nodes started with different settings (a different
//! `--lr`) are refused before any worker trains, naming the fields and the nodes; a second
//! agent registering a node rank another agent holds is refused naming the rank.
//!
//! The registration is text: a first line `agent ID`, then one `field=value` line per field.
//! A digest of the fields (FNV-1a, 64 bits) is printed so operators can compare nodes by eye.

use std::fmt::Write as _;

/// The most bytes of one value a refusal quotes.
const QUOTE: usize = 80;

/// One agent's registration for a generation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Registration {
    /// Who registered: host, process id and start time, unique per agent.
    pub agent: String,
    /// The run configuration, as named fields in a fixed order.
    pub fields: Vec<(String, String)>,
}

impl Registration {
    /// This agent's registration with `fields` (newlines in values become spaces).
    pub fn new(fields: Vec<(String, String)>) -> Registration {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let clean = |s: String| s.replace(['\n', '\r'], " ");
        Registration {
            agent: format!("{host} pid {} t{nanos}", std::process::id()),
            fields: fields
                .into_iter()
                .map(|(k, v)| (clean(k).replace('=', "_"), clean(v)))
                .collect(),
        }
    }

    /// The text stored under the node's admission key.
    pub fn encode(&self) -> String {
        let mut s = format!("agent {}\n", self.agent);
        for (k, v) in &self.fields {
            let _ = writeln!(s, "{k}={v}");
        }
        s
    }

    /// Reads [`Registration::encode`]'s text; `None` if it is not one (an older agent's
    /// `ready`, or damage).
    pub fn decode(bytes: &[u8]) -> Option<Registration> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        let agent = lines.next()?.strip_prefix("agent ")?.to_string();
        let fields = lines
            .map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Registration { agent, fields })
    }

    /// A 64-bit FNV-1a digest of the fields, as 16 hex digits.
    pub fn digest(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (k, v) in &self.fields {
            for b in k.bytes().chain([b'=']).chain(v.bytes()).chain([b'\n']) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("{h:016x}")
    }

    /// The fields in which `other` (node `theirs`) differs from this one (node `ours`), in
    /// words: `lr (node 0: 0.001, node 1: 0.002)`; empty when they agree. A field only one
    /// side has counts as different (`absent` on the other).
    pub fn differences(&self, ours: usize, other: &Registration, theirs: usize) -> Vec<String> {
        let quote = |v: Option<&String>| match v {
            None => "absent".to_string(),
            Some(v) if v.len() > QUOTE => {
                let mut end = QUOTE;
                while !v.is_char_boundary(end) {
                    end -= 1;
                }
                format!("{}...", &v[..end])
            }
            Some(v) => v.clone(),
        };
        let find = |r: &'_ Registration, k: &str| {
            r.fields
                .iter()
                .find(|(f, _)| f == k)
                .map(|(_, v)| v.clone())
        };
        let mut names: Vec<&String> = self.fields.iter().map(|(k, _)| k).collect();
        for (k, _) in &other.fields {
            if !names.contains(&k) {
                names.push(k);
            }
        }
        names
            .into_iter()
            .filter_map(|k| {
                let (a, b) = (find(self, k), find(other, k));
                (a != b).then(|| {
                    format!(
                        "{k} (node {ours}: {}, node {theirs}: {})",
                        quote(a.as_ref()),
                        quote(b.as_ref())
                    )
                })
            })
            .collect()
    }
}

/// The refusal of node `theirs`'s registration (differing from node `ours`'s in `diffs`).
pub fn mismatch(ours: usize, theirs: usize, diffs: &[String]) -> String {
    format!(
        "nodes {ours} and {theirs} were started with different run configurations: {}; \
         start every node with the same model, layout, hyperparameters, data and flotilla build",
        diffs.join("; ")
    )
}

/// The refusal of a second agent registering node rank `rank` in generation `g`.
pub fn duplicate(rank: usize, g: u64, holder: &str, me: &str) -> String {
    format!(
        "duplicate --node-rank {rank}: node rank {rank} of generation {g} is already registered \
         by another agent ({holder}); this agent ({me}) must be given a rank no other node has"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(lr: &str) -> Registration {
        Registration::new(vec![
            ("model".into(), "gpt\nmicro".into()),
            ("lr".into(), lr.into()),
            ("a=b".into(), "x".into()),
        ])
    }

    #[test]
    fn registrations_round_trip_and_name_their_differences() {
        let a = reg("0.001");
        let back = Registration::decode(a.encode().as_bytes()).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.fields[0].1, "gpt micro");
        assert_eq!(back.fields[2].0, "a_b");
        assert!(Registration::decode(b"ready").is_none());
        assert!(Registration::decode(b"agent x\nnoequals").is_none());
        let b = reg("0.002");
        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.digest(), reg("0.001").digest());
        assert!(a.differences(0, &reg("0.001"), 1).is_empty());
        let d = a.differences(0, &b, 1);
        assert_eq!(d, vec!["lr (node 0: 0.001, node 1: 0.002)".to_string()]);
        let mut c = reg(&"9".repeat(200));
        c.fields.push(("extra".into(), "1".into()));
        let d = a.differences(0, &c, 2);
        assert_eq!(d.len(), 2, "{d:?}");
        assert!(d[0].ends_with("...)") && d[0].len() < 140, "{}", d[0]);
        assert_eq!(d[1], "extra (node 0: absent, node 2: 1)");
        let m = mismatch(0, 1, &a.differences(0, &b, 1));
        assert!(
            m.contains("nodes 0 and 1") && m.contains("lr (node 0"),
            "{m}"
        );
        assert!(duplicate(1, 0, "h pid 1", "h pid 2").contains("--node-rank 1"));
    }

    #[test]
    fn gangs_refuse_differing_configurations_and_duplicate_ranks() {
        use crate::error::LaunchError;
        use crate::gang::Gang;
        use comm::store::{Secret, StoreClient, StoreServer};
        use std::time::Duration;
        let secret = Secret::new(b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
        let s = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
        let c =
            || StoreClient::connect(s.local_addr(), &secret, 0, Duration::from_secs(5)).unwrap();
        let (a, b, d) = (c(), c(), c());
        let lease = Duration::from_secs(2);
        let fields = |lr: &str| vec![("lr".to_string(), lr.to_string())];
        let wait = Duration::from_secs(10);
        // Generation 0: node 1 was started with another learning rate.
        let n0 = Gang::new(&a, 2, 0, lease).with_agreement(fields("0.001"));
        let n1 = Gang::new(&b, 2, 1, lease).with_agreement(fields("0.002"));
        std::thread::scope(|scope| {
            let h = scope.spawn(|| n1.admit(0, wait));
            let e = n0.admit(0, wait).unwrap_err();
            assert!(matches!(e, LaunchError::Refused(_)), "{e}");
            let e = e.to_string();
            assert!(e.contains("lr (node 0: 0.001, node 1: 0.002)"), "{e}");
            let e1 = h.join().unwrap().unwrap_err().to_string();
            assert!(e1.contains("lr (node 0: 0.001, node 1: 0.002)"), "{e1}");
        });
        // Generation 1 of a 3-node job: two agents claim node rank 1 while node 2 is missing.
        assert_eq!(a.bump_generation(0).unwrap(), 1);
        for x in [&a, &b, &d] {
            x.set_generation(1);
        }
        let n0 = Gang::new(&a, 3, 0, lease);
        let (n1, dup) = (Gang::new(&b, 3, 1, lease), Gang::new(&d, 3, 1, lease));
        std::thread::scope(|scope| {
            let h0 = scope.spawn(|| n0.admit(1, wait));
            let h1 = scope.spawn(|| n1.admit(1, wait));
            let e = dup.admit(1, wait).unwrap_err().to_string();
            for e in [e, h0.join().unwrap().unwrap_err().to_string()] {
                assert!(e.contains("duplicate --node-rank 1"), "{e}");
            }
            let e1 = h1.join().unwrap().unwrap_err();
            assert!(matches!(e1, LaunchError::Refused(_)), "{e1}");
        });
    }
}
