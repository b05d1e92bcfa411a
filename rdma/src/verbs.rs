//! The ibverbs backend (cargo feature `ibverbs`, through `sideway`, which
//! loads libibverbs with dlopen): a protection domain per manager, every
//! registered buffer a memory region (local write, remote read and write),
//! and per owner an RC queue pair whose setup goes over the owner's tcp
//! endpoint (so it is authenticated like the tcp backend). Reads and writes
//! are signalled RDMA READ and RDMA WRITE work requests; the reader polls
//! the completion queue with a deadline. The owner's CPU does nothing.
//!
//! Without the feature, or without a device, [`available`] says why and
//! the manager never offers or chooses this backend.

/// Bytes of an encoded [`QpEndpoint`].
pub(crate) const QP_ENDPOINT_BYTES: usize = 32;

/// What the other end of an RC queue pair needs to connect to this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QpEndpoint {
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
}

impl QpEndpoint {
    pub(crate) fn encode(&self) -> [u8; QP_ENDPOINT_BYTES] {
        let mut b = [0u8; QP_ENDPOINT_BYTES];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    /// Any 32 bytes decode; the verbs calls reject nonsense (a wrong qpn or
    /// gid only fails to connect). The psn is masked to its 24 bits.
    pub(crate) fn decode(b: &[u8; QP_ENDPOINT_BYTES]) -> Self {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        Self {
            qpn: u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x00ff_ffff,
            psn: u32::from_le_bytes([b[4], b[5], b[6], b[7]]) & 0x00ff_ffff,
            lid: u16::from_le_bytes([b[8], b[9]]),
            gid,
        }
    }
}

/// Whether a verbs device can be used here; the error says why not
/// (built without the `ibverbs` feature, libibverbs missing, no device).
pub fn available() -> Result<(), String> {
    imp::available()
}

pub(crate) use imp::{Device, MemoryRegion, QueuePair};

#[cfg(not(feature = "ibverbs"))]
mod imp {
    //! Without the feature: the types are uninhabited, so no value of them
    //! exists and every method is unreachable by construction.
    use super::QpEndpoint;
    use crate::error::Error;
    use crate::memory::Region;

    pub(super) fn available() -> Result<(), String> {
        Err("built without the `ibverbs` feature".into())
    }

    /// An open device (none without the feature).
    pub(crate) enum Device {}
    /// A registered memory region (none without the feature).
    pub(crate) enum MemoryRegion {}
    /// A connected RC queue pair (none without the feature).
    pub(crate) enum QueuePair {}

    impl Device {
        pub(crate) fn open(_name: Option<&str>) -> Result<Self, Error> {
            Err(Error::Unavailable {
                backend: crate::BackendKind::Ibverbs,
                reason: available().err().unwrap_or_default(),
            })
        }
        pub(crate) fn register(
            &self,
            _region: &Region,
            _access: crate::Access,
        ) -> Result<MemoryRegion, Error> {
            match *self {}
        }
        pub(crate) fn new_qp(&self) -> Result<(QueuePair, QpEndpoint), Error> {
            match *self {}
        }
        pub(crate) fn accept_qp(
            &self,
            _client: QpEndpoint,
        ) -> Result<(QueuePair, QpEndpoint), Error> {
            match *self {}
        }
    }

    impl MemoryRegion {
        pub(crate) fn rkey(&self) -> u32 {
            match *self {}
        }
        pub(crate) fn lkey(&self) -> u32 {
            match *self {}
        }
    }

    impl QueuePair {
        pub(crate) fn connect(&mut self, _remote: QpEndpoint) -> Result<(), Error> {
            match *self {}
        }
        #[allow(clippy::too_many_arguments)]
        pub(crate) async fn transfer(
            &mut self,
            _write: bool,
            _lkey: u32,
            _local: u64,
            _len: u32,
            _rkey: u32,
            _remote: u64,
            _deadline: std::time::Duration,
        ) -> Result<(), Error> {
            match *self {}
        }
    }
}

#[cfg(feature = "ibverbs")]
mod imp {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use sideway::ibverbs::AccessFlags;
    use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
    use sideway::ibverbs::completion::{
        ExtendedCompletionQueue, GenericCompletionQueue, PollCompletionQueueError,
        WorkCompletionStatus,
    };
    use sideway::ibverbs::device::{DeviceInfo, DeviceList};
    use sideway::ibverbs::device_context::{DeviceContext, Mtu};
    use sideway::ibverbs::protection_domain::ProtectionDomain;
    use sideway::ibverbs::queue_pair::{
        ExtendedQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairState,
        SetScatterGatherEntry, WorkRequestFlags,
    };

    use super::QpEndpoint;
    use crate::error::Error;
    use crate::memory::Region;

    const PORT: u8 = 1;
    const GID_INDEX: u8 = 0;
    /// Work requests in flight per queue pair (one at a time: each transfer
    /// waits for its completion).
    const MAX_SEND_WR: u32 = 16;
    /// Outstanding RDMA READs as initiator and responder.
    const MAX_RD_ATOMIC: u8 = 16;

    fn verbs_err(context: &'static str) -> impl FnOnce(String) -> Error {
        move |reason| Error::Verbs { context, reason }
    }

    pub(super) fn available() -> Result<(), String> {
        // Any failure (libibverbs missing, no kernel support: ENOSYS) means
        // no device.
        let list = DeviceList::new().map_err(|e| format!("no RDMA device: {e}"))?;
        if list.iter().next().is_none() {
            return Err("no RDMA device".into());
        }
        Ok(())
    }

    /// An open device: its context, protection domain and port addressing.
    pub(crate) struct Device {
        ctx: Arc<DeviceContext>,
        pd: Arc<ProtectionDomain>,
        lid: u16,
        gid: Gid,
    }

    /// A registered memory region.
    pub(crate) struct MemoryRegion(Arc<sideway::ibverbs::memory_region::MemoryRegion>);

    /// An RC queue pair with its own completion queue.
    pub(crate) struct QueuePair {
        qp: ExtendedQueuePair,
        cq: Arc<ExtendedCompletionQueue>,
        psn: u32,
        next_wr: u64,
    }

    impl Device {
        /// Opens the named device (or the first one).
        pub(crate) fn open(name: Option<&str>) -> Result<Self, Error> {
            let unavailable = |reason: String| Error::Unavailable {
                backend: crate::BackendKind::Ibverbs,
                reason,
            };
            let list =
                DeviceList::new().map_err(|e| unavailable(format!("no RDMA device: {e}")))?;
            let device = list
                .iter()
                .find(|d| name.is_none_or(|n| d.name() == n))
                .ok_or_else(|| unavailable(format!("no RDMA device {}", name.unwrap_or(""))))?;
            let ctx = device
                .open()
                .map_err(|e| verbs_err("open device")(e.to_string()))?;
            let pd = ctx
                .alloc_pd()
                .map_err(|e| verbs_err("alloc pd")(e.to_string()))?;
            let port = ctx
                .query_port(PORT)
                .map_err(|e| verbs_err("query port")(e.to_string()))?;
            let gid = ctx
                .query_gid(PORT, u32::from(GID_INDEX))
                .map_err(|e| verbs_err("query gid")(e.to_string()))?;
            Ok(Self {
                lid: port.lid(),
                ctx,
                pd,
                gid,
            })
        }

        /// Registers a region's data for local write, and for what `access`
        /// lets peers do: remote read and write (`Exposed`), remote read
        /// (`ReadOnly`), nothing remote (`Local`). A peer's RDMA beyond that
        /// fails at its NIC with a remote access error.
        pub(crate) fn register(
            &self,
            region: &Region,
            access: crate::Access,
        ) -> Result<MemoryRegion, Error> {
            let flags = match access {
                crate::Access::Exposed => {
                    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead
                }
                crate::Access::ReadOnly => AccessFlags::LocalWrite | AccessFlags::RemoteRead,
                crate::Access::Local => AccessFlags::LocalWrite,
            };
            // SAFETY: the data pointer is valid for `len_bytes` for as long as
            // the region is mapped; the manager keeps the `Region` (an `Arc`)
            // alive for longer than the memory region, which is dropped
            // (deregistered) first when the buffer is released.
            let mr = unsafe {
                self.pd
                    .reg_mr(region.data_ptr() as usize, region.len_bytes(), flags)
            }
            .map_err(|e| verbs_err("register memory")(e.to_string()))?;
            Ok(MemoryRegion(mr))
        }

        /// A new queue pair in INIT, and the endpoint the peer connects to.
        pub(crate) fn new_qp(&self) -> Result<(QueuePair, QpEndpoint), Error> {
            let cq = self
                .ctx
                .create_cq_builder()
                .setup_cqe(MAX_SEND_WR * 2)
                .build_ex()
                .map_err(|e| verbs_err("create cq")(e.to_string()))?;
            let handle = GenericCompletionQueue::from(Arc::clone(&cq));
            let mut qp = self
                .pd
                .create_qp_builder()
                .setup_send_cq(handle.clone())
                .setup_recv_cq(handle)
                .setup_max_send_wr(MAX_SEND_WR)
                .setup_max_recv_wr(1)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .build_ex()
                .map_err(|e| verbs_err("create qp")(e.to_string()))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(PORT)
                .setup_access_flags(
                    AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
                );
            qp.modify(&attr)
                .map_err(|e| verbs_err("qp to INIT")(e.to_string()))?;
            let mut psn = [0u8; 4];
            regent_net::tls::crypto_provider()
                .secure_random
                .fill(&mut psn)
                .map_err(|_| verbs_err("psn")("no random source".into()))?;
            let psn = u32::from_le_bytes(psn) & 0x00ff_ffff;
            let endpoint = QpEndpoint {
                qpn: qp.qp_number(),
                psn,
                lid: self.lid,
                gid: self.gid.raw,
            };
            Ok((
                QueuePair {
                    qp,
                    cq,
                    psn,
                    next_wr: 0,
                },
                endpoint,
            ))
        }

        /// The owner's side of a connection request: a queue pair connected
        /// to the client's, and its endpoint for the client.
        pub(crate) fn accept_qp(
            &self,
            client: QpEndpoint,
        ) -> Result<(QueuePair, QpEndpoint), Error> {
            let (mut qp, mine) = self.new_qp()?;
            qp.connect(client)?;
            Ok((qp, mine))
        }
    }

    impl MemoryRegion {
        pub(crate) fn rkey(&self) -> u32 {
            self.0.rkey()
        }
        pub(crate) fn lkey(&self) -> u32 {
            self.0.lkey()
        }
    }

    impl QueuePair {
        /// INIT -> RTR -> RTS towards `remote`.
        pub(crate) fn connect(&mut self, remote: QpEndpoint) -> Result<(), Error> {
            let gid = Gid { raw: remote.gid };
            let mut ah = AddressHandleAttribute::new();
            ah.setup_dest_lid(remote.lid)
                .setup_port(PORT)
                .setup_service_level(0);
            if !gid.is_zero() {
                // RoCE (or a routed IB fabric): address by GID.
                ah.setup_grh_src_gid_index(GID_INDEX)
                    .setup_grh_dest_gid(&gid)
                    .setup_grh_hop_limit(1);
            }
            let mut rtr = QueuePairAttribute::new();
            rtr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(Mtu::Mtu1024)
                .setup_dest_qp_num(remote.qpn)
                .setup_rq_psn(remote.psn)
                .setup_max_dest_read_atomic(MAX_RD_ATOMIC)
                .setup_min_rnr_timer(12)
                .setup_address_vector(&ah);
            self.qp
                .modify(&rtr)
                .map_err(|e| verbs_err("qp to RTR")(e.to_string()))?;
            let mut rts = QueuePairAttribute::new();
            rts.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(self.psn)
                .setup_timeout(14)
                .setup_retry_cnt(7)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(MAX_RD_ATOMIC);
            self.qp
                .modify(&rts)
                .map_err(|e| verbs_err("qp to RTS")(e.to_string()))
        }

        /// One signalled RDMA READ (`write == false`: remote -> local) or
        /// RDMA WRITE (local -> remote), waited for with a deadline.
        #[allow(clippy::too_many_arguments)]
        pub(crate) async fn transfer(
            &mut self,
            write: bool,
            lkey: u32,
            local: u64,
            len: u32,
            rkey: u32,
            remote: u64,
            deadline: Duration,
        ) -> Result<(), Error> {
            let wr_id = self.next_wr;
            self.next_wr = self.next_wr.wrapping_add(1);
            {
                let mut guard = self.qp.start_post_send();
                let wr = guard.construct_wr(wr_id, WorkRequestFlags::Signaled);
                let wr = if write {
                    wr.setup_write(rkey, remote)
                } else {
                    wr.setup_read(rkey, remote)
                };
                // SAFETY: `local..local + len` lies inside a memory region
                // registered with this protection domain under `lkey` (the
                // manager looks it up or stages through its bounce buffer),
                // and the caller keeps that memory borrowed until this
                // function returns, which is after the completion (or after
                // the queue pair is torn down on error).
                unsafe { wr.setup_sge(lkey, local, len) };
                guard
                    .post()
                    .map_err(|e| verbs_err("post send")(e.to_string()))?;
            }
            let started = Instant::now();
            loop {
                match self.cq.start_poll() {
                    Ok(mut poller) => {
                        if let Some(wc) = poller.next() {
                            let status = wc.status();
                            if wc.wr_id() != wr_id {
                                continue;
                            }
                            if status != WorkCompletionStatus::Success as u32 {
                                return Err(Error::Verbs {
                                    context: if write { "rdma write" } else { "rdma read" },
                                    reason: format!(
                                        "completion status {:?}",
                                        WorkCompletionStatus::from(status)
                                    ),
                                });
                            }
                            return Ok(());
                        }
                    }
                    Err(PollCompletionQueueError::CompletionQueueEmpty) => {}
                    Err(e) => return Err(verbs_err("poll cq")(e.to_string())),
                }
                if started.elapsed() > deadline {
                    return Err(Error::Timeout {
                        what: "rdma completion",
                        after: deadline,
                    });
                }
                tokio::task::yield_now().await;
            }
        }
    }
}
