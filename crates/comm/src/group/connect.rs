//! Building a group's links: publish this rank's addresses through the store, learn everyone
//! else's, then open one TCP connection per pair of ranks on different hosts (or every pair,
//! under `TransportPolicy::TcpOnly`) and one shared-memory link per pair on the same host.
//!
//! A TCP connection opens with a Hello frame and an HMAC of the acceptor's published nonce,
//! the group id, the generation and the sender's rank under the job secret, so a stranger, a rank
//! of another group or a rank of an older generation cannot take a peer's place.

use super::config::{GroupConfig, TransportPolicy};
use crate::algo::direct_read::{PROBE_BYTE, probe};
use crate::dtype::DType;
use crate::error::{CommError, Result};
use crate::frame::{FrameHeader, FrameType, HEADER_LEN, OpKind};
use crate::store::{Secret, StoreClient, hmac_sha256, verify_hmac_sha256};
use crate::transport::shm::{ShmDomain, ShmEndpoint};
use crate::transport::tcp::TcpLink;
use crate::transport::{Link, LinkKind};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// What each rank publishes about itself.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RankInfo {
    pub rank: usize,
    pub host: String,
    pub addr: SocketAddr,
    pub pid: u32,
    pub nonce: String,
    pub shm: Option<ShmEndpoint>,
    /// Address of this process's [`PROBE_BYTE`], for the cross-memory-attach permission test.
    pub probe_addr: usize,
}

/// The connected links of one rank in a group.
pub(crate) struct Wiring {
    pub links: Vec<Option<Box<dyn Link>>>,
    pub kinds: Vec<Option<LinkKind>>,
    /// Host index of every group rank (0-based, in order of first appearance).
    pub host_of: Vec<usize>,
    /// Host identity strings, by host index.
    pub host_names: Vec<String>,
    /// Process id of every group rank.
    pub pids: Vec<i32>,
    /// Whether every rank may read the memory of every rank on its host (agreed by all ranks).
    pub direct_read: bool,
    /// Kept alive so the doorbell fd stays open.
    pub _shm: Option<ShmDomain>,
}

/// This machine's identity: ranks with the same identity can share memory. Network namespaces
/// count as separate hosts (that is how tests emulate several hosts on one machine).
pub fn default_host_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{}/{}", host.trim(), boot.trim(), netns)
}

/// The local address of the route towards `store` (what peers can most likely reach).
fn route_addr(store: SocketAddr) -> IpAddr {
    UdpSocket::bind(SocketAddr::new(
        if store.is_ipv4() {
            [0, 0, 0, 0].into()
        } else {
            [0u16; 8].into()
        },
        0,
    ))
    .and_then(|s| {
        s.connect(store)?;
        s.local_addr()
    })
    .map(|a| a.ip())
    .unwrap_or(store.ip())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn random_nonce() -> Result<String> {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b)
        .map_err(|e| CommError::Config(format!("no randomness for a nonce: {e}")))?;
    Ok(hex(&b))
}

/// The fields a connection hello authenticates.
struct HelloParts {
    nonce: Vec<u8>,
    tail: [u8; 24],
}

impl HelloParts {
    fn as_slices(&self) -> [&[u8]; 3] {
        [b"flotilla-link-v1", &self.nonce, &self.tail]
    }
}

fn hello_parts(nonce: &str, group_id: u64, generation: u64, sender: usize) -> HelloParts {
    let mut tail = [0u8; 24];
    tail[..8].copy_from_slice(&group_id.to_le_bytes());
    tail[8..16].copy_from_slice(&generation.to_le_bytes());
    tail[16..].copy_from_slice(&(sender as u64).to_le_bytes());
    HelloParts {
        nonce: nonce.as_bytes().to_vec(),
        tail,
    }
}

fn hello_mac(
    secret: &Secret,
    nonce: &str,
    group_id: u64,
    generation: u64,
    sender: usize,
) -> [u8; 32] {
    hmac_sha256(
        secret.as_bytes(),
        &hello_parts(nonce, group_id, generation, sender).as_slices(),
    )
}

/// Parameters of one wiring.
pub(crate) struct WireSpec<'a> {
    pub store: &'a StoreClient,
    pub store_addr: SocketAddr,
    pub secret: &'a Secret,
    pub prefix: &'a str,
    pub group_id: u64,
    pub generation: u64,
    pub rank: usize,
    pub size: usize,
    pub cfg: &'a GroupConfig,
}

/// Rendezvous and connect all links of this rank.
pub(crate) fn wire(w: &WireSpec<'_>) -> Result<Wiring> {
    let deadline = Instant::now() + w.cfg.connect_timeout;
    let host = w.cfg.host_id.clone().unwrap_or_else(default_host_id);
    let ip = w
        .cfg
        .advertise_addr
        .unwrap_or_else(|| route_addr(w.store_addr));
    let listener = TcpListener::bind(SocketAddr::new(ip, 0))
        .map_err(|e| CommError::io(format!("listen on {ip}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CommError::io("listener address", e))?;
    let nonce = random_nonce()?;

    // Who shares this host? Publish host first so the shm domain can be sized for local peers.
    let host_key = |r: usize| format!("{}/host/{r}", w.prefix);
    w.store.set(&host_key(w.rank), host.as_bytes())?;
    let hosts: Vec<String> = (0..w.size)
        .map(|r| {
            wait_or_abort(w, &host_key(r), deadline)
                .map(|v| String::from_utf8_lossy(&v).into_owned())
        })
        .collect::<Result<_>>()?;
    let use_shm =
        |a: usize, b: usize| w.cfg.transport == TransportPolicy::Auto && hosts[a] == hosts[b];
    let local_peers: Vec<usize> = (0..w.size)
        .filter(|&r| r != w.rank && use_shm(w.rank, r))
        .collect();
    let shm = if local_peers.is_empty() {
        None
    } else {
        // Unique per group creation: the same group name and generation can exist in several
        // jobs (or tests) of one process.
        let name = format!("flotilla-{}-{nonce}", std::process::id());
        Some(
            ShmDomain::create(
                &w.cfg.shm_dir,
                &name,
                w.rank,
                &local_peers,
                w.cfg.shm_ring_bytes,
            )
            .map_err(|e| {
                CommError::io(
                    format!("create shared memory in {}", w.cfg.shm_dir.display()),
                    e,
                )
            })?,
        )
    };
    let me = RankInfo {
        rank: w.rank,
        host: host.clone(),
        addr,
        pid: std::process::id(),
        nonce: nonce.clone(),
        shm: shm.as_ref().map(|d| d.endpoint().clone()),
        probe_addr: &PROBE_BYTE as *const u8 as usize,
    };
    let info_key = |r: usize| format!("{}/info/{r}", w.prefix);
    w.store.set(
        &info_key(w.rank),
        &serde_json::to_vec(&me).expect("RankInfo serialises"),
    )?;
    let infos: Vec<RankInfo> = (0..w.size)
        .map(|r| {
            let v = wait_or_abort(w, &info_key(r), deadline)?;
            serde_json::from_slice(&v).map_err(|e| {
                CommError::Store(format!("rank {r}'s published info is not valid: {e}"))
            })
        })
        .collect::<Result<_>>()?;

    let mut links: Vec<Option<Box<dyn Link>>> = (0..w.size).map(|_| None).collect();
    let mut kinds = vec![None; w.size];
    // Shared memory with local peers.
    if let Some(d) = &shm {
        for &p in &local_peers {
            let ep = infos[p].shm.as_ref().ok_or_else(|| {
                CommError::Store(format!(
                    "rank {p} shares host '{}' but published no shared-memory endpoint",
                    hosts[p]
                ))
            })?;
            let link = d
                .connect(ep)
                .map_err(|e| CommError::io(format!("map shared memory of rank {p}"), e))?;
            links[p] = Some(Box::new(link));
            kinds[p] = Some(LinkKind::Shm);
        }
    }
    // TCP: connect to lower ranks, accept from higher ranks.
    let tcp_peers: Vec<usize> = (0..w.size)
        .filter(|&r| r != w.rank && !use_shm(w.rank, r))
        .collect();
    let expect_accept: Vec<usize> = tcp_peers.iter().copied().filter(|&r| r > w.rank).collect();
    let acceptor = {
        let secret = w.secret.clone();
        let (gid, generation, rank) = (w.group_id, w.generation, w.rank);
        let nonce = nonce.clone();
        std::thread::Builder::new()
            .name(format!("flotilla-accept-{rank}"))
            .spawn(move || {
                accept_peers(
                    listener,
                    &secret,
                    &nonce,
                    gid,
                    generation,
                    &expect_accept,
                    deadline,
                )
            })
            .map_err(|e| CommError::io("spawn acceptor thread", e))?
    };
    for &p in tcp_peers.iter().filter(|&&r| r < w.rank) {
        let s = dial(&infos[p], w, deadline)?;
        links[p] = Some(Box::new(TcpLink::new(s).map_err(|e| {
            CommError::io(format!("configure socket to rank {p}"), e)
        })?));
        kinds[p] = Some(LinkKind::Tcp);
    }
    let accepted = acceptor
        .join()
        .map_err(|_| CommError::Store("acceptor thread panicked".into()))??;
    for (p, s) in accepted {
        links[p] = Some(Box::new(TcpLink::new(s).map_err(|e| {
            CommError::io(format!("configure socket from rank {p}"), e)
        })?));
        kinds[p] = Some(LinkKind::Tcp);
    }

    // Everyone is connected: the shared-memory files can go (mappings stay valid). Each rank
    // also reports whether it may read its local peers' memory; single-copy algorithms are used
    // only if all can.
    let may_read = w.cfg.direct_read
        && !local_peers.is_empty()
        && local_peers
            .iter()
            .all(|&p| probe(infos[p].pid as i32, infos[p].probe_addr));
    let ready_key = |r: usize| format!("{}/wired/{r}", w.prefix);
    w.store
        .set(&ready_key(w.rank), if may_read { b"1" } else { b"0" })?;
    let mut direct_read = true;
    for r in 0..w.size {
        direct_read &= wait_or_abort(w, &ready_key(r), deadline)? == b"1";
    }
    if let Some(d) = &shm {
        let _ = d.unlink_files();
    }
    let mut host_names: Vec<String> = Vec::new();
    let host_of = hosts
        .iter()
        .map(|h| match host_names.iter().position(|x| x == h) {
            Some(i) => i,
            None => {
                host_names.push(h.clone());
                host_names.len() - 1
            }
        })
        .collect();
    Ok(Wiring {
        links,
        kinds,
        host_of,
        host_names,
        pids: infos.iter().map(|i| i.pid as i32).collect(),
        direct_read,
        _shm: shm,
    })
}

/// The store key under which a rank that failed while the group was being created says why.
pub(crate) fn wiring_abort_key(prefix: &str) -> String {
    format!("{prefix}/wiring-failed")
}

/// Waits for `key` until `deadline`, looking every second for another rank's report that it
/// failed to join (then failing at once with that report instead of waiting out the deadline).
fn wait_or_abort(w: &WireSpec<'_>, key: &str, deadline: Instant) -> Result<Vec<u8>> {
    loop {
        let slice = remaining(deadline).min(Duration::from_secs(1));
        match w.store.wait_one(key, slice) {
            Ok(v) => return Ok(v),
            Err(e) => {
                if let Ok(Some(why)) = w.store.get(&wiring_abort_key(w.prefix)) {
                    return Err(CommError::Store(format!(
                        "group creation abandoned: {}",
                        String::from_utf8_lossy(&why)
                    )));
                }
                if Instant::now() >= deadline {
                    return Err(e);
                }
            }
        }
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn hello_header(group_id: u64, generation: u64, sender: usize) -> FrameHeader {
    FrameHeader {
        frame_type: FrameType::Hello,
        kind: OpKind::Connect,
        dtype: DType::U8,
        group_id,
        generation,
        seq: 0,
        signature: 0,
        payload_len: 32,
        sender: sender as u32,
        step: 0,
    }
}

/// Connects to a lower rank and introduces this one.
fn dial(peer: &RankInfo, w: &WireSpec<'_>, deadline: Instant) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    let mut s = loop {
        match TcpStream::connect_timeout(
            &peer.addr,
            remaining(deadline).min(Duration::from_secs(5)),
        ) {
            Ok(s) => break s,
            Err(e) if Instant::now() + backoff < deadline => {
                tracing::debug!(
                    "connect to rank {} at {}: {e}; retrying",
                    peer.rank,
                    peer.addr
                );
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Err(e) => {
                return Err(CommError::io(
                    format!("connect to rank {} at {}", peer.rank, peer.addr),
                    e,
                ));
            }
        }
    };
    let mut msg = Vec::with_capacity(HEADER_LEN + 32);
    msg.extend_from_slice(&hello_header(w.group_id, w.generation, w.rank).encode());
    msg.extend_from_slice(&hello_mac(
        w.secret,
        &peer.nonce,
        w.group_id,
        w.generation,
        w.rank,
    ));
    s.set_write_timeout(Some(remaining(deadline))).ok();
    s.write_all(&msg)
        .map_err(|e| CommError::io(format!("hello to rank {}", peer.rank), e))?;
    Ok(s)
}

/// Accepts connections until every rank in `expect` has introduced itself correctly.
fn accept_peers(
    listener: TcpListener,
    secret: &Secret,
    nonce: &str,
    group_id: u64,
    generation: u64,
    expect: &[usize],
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut got: Vec<(usize, TcpStream)> = Vec::with_capacity(expect.len());
    while got.len() < expect.len() {
        let wait_ms = remaining(deadline).as_millis().min(i32::MAX as u128) as i32;
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, wait_ms) };
        if rc == 0 || Instant::now() >= deadline {
            let missing: Vec<usize> = expect
                .iter()
                .copied()
                .filter(|r| !got.iter().any(|(g, _)| g == r))
                .collect();
            return Err(CommError::Store(format!(
                "timed out waiting for connections from rank(s) {missing:?}"
            )));
        }
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CommError::io("accept", e)),
        };
        s.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(10))))
            .ok();
        let mut buf = [0u8; HEADER_LEN + 32];
        if let Err(e) = s.read_exact(&mut buf) {
            tracing::warn!("dropping connection from {from}: no complete hello ({e})");
            continue;
        }
        let verdict = FrameHeader::decode(&buf[..HEADER_LEN])
            .map_err(|e| e.to_string())
            .and_then(|h| {
                let sender = h.sender as usize;
                if h.frame_type != FrameType::Hello || h.group_id != group_id {
                    Err(format!(
                        "not a hello for this group ({:?}, group {:#x})",
                        h.frame_type, h.group_id
                    ))
                } else if h.generation != generation {
                    Err(format!(
                        "generation {} (this group is at {generation})",
                        h.generation
                    ))
                } else if !expect.contains(&sender) || got.iter().any(|(g, _)| *g == sender) {
                    Err(format!("unexpected rank {sender}"))
                } else if !verify_hmac_sha256(
                    secret.as_bytes(),
                    &hello_parts(nonce, group_id, generation, sender).as_slices(),
                    &buf[HEADER_LEN..],
                ) {
                    Err(format!("rank {sender} failed authentication"))
                } else {
                    Ok(sender)
                }
            });
        match verdict {
            Ok(sender) => {
                s.set_read_timeout(None).ok();
                got.push((sender, s));
            }
            Err(why) => tracing::warn!("refused connection from {from}: {why}"),
        }
    }
    Ok(got)
}
