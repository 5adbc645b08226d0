//! CUDA device memory through the staging path. Runs where a CUDA driver and a GPU exist; here
//! (no driver) it prints why it skips and checks the typed error instead.
use cudarc::driver::{CudaContext, DevicePtr};
use kvlink::memory::{MemoryKind, Registry};
use kvlink::transport::cuda::{driver_present, Staging};
use kvlink::ErrorKind;

#[test]
fn device_memory_round_trip_through_staging() {
    if !driver_present() {
        println!("SKIP device_memory_round_trip_through_staging: no CUDA driver (libcuda) on this machine");
        let e = Registry::new()
            .register(0x7000_0000, 1 << 20, MemoryKind::Cuda { device: 0 })
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Cuda);
        return;
    }
    if CudaContext::device_count().unwrap_or(0) == 0 {
        println!("SKIP device_memory_round_trip_through_staging: CUDA driver present but no GPU");
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let len = 8 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let d_src = stream.clone_htod(&src).unwrap();
    let d_dst = stream.alloc_zeros::<u8>(len).unwrap();
    let (src_ptr, _g1) = d_src.device_ptr(&stream);
    let (dst_ptr, _g2) = d_dst.device_ptr(&stream);
    stream.synchronize().unwrap();
    let reg = Registry::new();
    let r = reg
        .register(src_ptr, len as u64, MemoryKind::Cuda { device: 0 })
        .unwrap();
    assert_eq!(r.slice(0, len as u64).unwrap(), src_ptr);
    let mut st = Staging::new(0, len).unwrap();
    st.from_device(src_ptr, len).unwrap();
    st.to_device(dst_ptr, len).unwrap();
    // The pinned buffer goes back to the device's pool and is reused, not allocated again.
    drop(st);
    let (kept, bytes) = kvlink::transport::cuda::staging_cached(0);
    assert!(
        kept >= 1 && bytes >= len,
        "pool keeps {kept} buffers, {bytes} bytes"
    );
    let again = Staging::new(0, len).unwrap();
    assert_eq!(
        kvlink::transport::cuda::staging_cached(0).0,
        kept - 1,
        "reused"
    );
    drop(again);
    drop((_g1, _g2));
    let back = stream.clone_dtoh(&d_dst).unwrap();
    assert_eq!(
        back, src,
        "device -> pinned host -> device must keep every byte"
    );
}

/// A context engine (rank 0, listening) and a generation engine (rank 1) over tcp, connected,
/// with the given agreement bound (None: the default).
fn device_pair(
    bound: Option<std::time::Duration>,
) -> (kvlink::connection::Engine, kvlink::connection::Engine) {
    use kvlink::connection::{Engine, EngineConfig};
    use kvlink::proto::RankId;
    use kvlink::transport::TransportKind;
    use std::time::{Duration, Instant};
    let config = |name: &str, rank| {
        let mut c = EngineConfig::new(name, rank, TransportKind::Tcp);
        if let Some(b) = bound {
            c.agreement_bound = b;
        }
        c
    };
    let mut c = config("ctx", 0);
    c.listen = Some("127.0.0.1:0".parse().unwrap());
    let sender = Engine::new(c).unwrap();
    let receiver = Engine::new(config("gen", 1)).unwrap();
    let dl = Instant::now() + Duration::from_secs(20);
    receiver.connect(&sender.address(), dl).unwrap();
    sender.wait_peer(RankId(1), dl).unwrap();
    (sender, receiver)
}

/// The receiver advertises `len` bytes of device 0 at `addr` as segment 0 of `key`; the sender
/// takes the advertisement and accepts it. Returns the receiving rank as the sender names it.
///
/// # Safety
/// `addr` stays valid device memory of `len` bytes until the request's end is waited for, or
/// is memory the driver refuses to copy to.
unsafe fn advertise_device(
    sender: &kvlink::connection::Engine,
    receiver: &kvlink::connection::Engine,
    key: kvlink::proto::RequestKey,
    addr: u64,
    len: usize,
) -> kvlink::proto::RankId {
    use kvlink::connection::BufferSpec;
    use kvlink::proto::{BufferKind, RankId};
    use std::time::{Duration, Instant};
    let spec = BufferSpec {
        kind: BufferKind::Kv,
        segment: 0,
        addr,
        len: len as u64,
        device_id: 0,
    };
    receiver
        .advertise(key, vec![RankId(1)], vec![(RankId(0), vec![spec])], vec![])
        .unwrap();
    let adv = sender
        .next_advertisement(Instant::now() + Duration::from_secs(20), None)
        .unwrap();
    sender.accept(key, adv.from, true).unwrap();
    adv.from
}

#[test]
fn engine_moves_device_memory_through_staging() {
    use kvlink::proto::{RequestKey, Role};
    use kvlink::Outcome;
    use std::time::{Duration, Instant};
    if !driver_present() || CudaContext::device_count().unwrap_or(0) == 0 {
        println!("SKIP engine_moves_device_memory_through_staging: no CUDA driver or GPU on this machine");
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let len = 4 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
    let d_src = stream.clone_htod(&src).unwrap();
    let d_dst = stream.alloc_zeros::<u8>(len).unwrap();
    let (src_ptr, g1) = d_src.device_ptr(&stream);
    let (dst_ptr, g2) = d_dst.device_ptr(&stream);
    stream.synchronize().unwrap();

    let (sender, receiver) = device_pair(None);
    let dl = Instant::now() + Duration::from_secs(20);
    let key = RequestKey::new(1, 0);
    // SAFETY: d_dst outlives the request (waited below).
    let to = unsafe { advertise_device(&sender, &receiver, key, dst_ptr, len) };
    // Another request's staging is held for the whole transfer: this one must not wait for it.
    let held = kvlink::transport::cuda::Staging::new(0, len).unwrap();
    assert_eq!(
        sender
            .send_device(key, to, 0, 0, src_ptr, len, dl, None)
            .unwrap(),
        Outcome::Completed
    );
    assert_eq!(
        receiver.wait(key, Role::Receiver, dl, None).unwrap(),
        Outcome::Completed
    );
    drop(held);
    drop((g1, g2));
    assert_eq!(
        stream.clone_dtoh(&d_dst).unwrap(),
        src,
        "device -> device through kvlink"
    );
}

/// A copy from the staging buffer to the device that fails (here: a device address no
/// allocation holds) ends the request `Cancelled` on both ranks at once: the receive is told
/// over without data, so the receiver does not wait out its agreement bound (5 s here) for a
/// receive that had already ended.
#[test]
fn a_failed_copy_to_the_device_cancels_the_request_at_once() {
    use kvlink::proto::{RequestKey, Role};
    use kvlink::Outcome;
    use std::time::{Duration, Instant};
    if !driver_present() || CudaContext::device_count().unwrap_or(0) == 0 {
        println!("SKIP a_failed_copy_to_the_device_cancels_the_request_at_once: no CUDA driver or GPU on this machine");
        return;
    }
    let bound = Duration::from_secs(5);
    let (sender, receiver) = device_pair(Some(bound));
    let dl = Instant::now() + Duration::from_secs(20);
    let key = RequestKey::new(2, 0);
    let len = 1 << 16;
    // SAFETY: nothing is ever written at the first page: no allocation lives there, and the
    // driver refuses the copy to it.
    let to = unsafe { advertise_device(&sender, &receiver, key, 0x10, len) };
    let data = vec![7u8; len];
    let _ = sender.send(key, to, 0, &data, dl, None).unwrap();
    let t0 = Instant::now();
    let r = receiver.wait(key, Role::Receiver, dl, None).unwrap();
    let took = t0.elapsed();
    println!("receiver: {r:?} in {took:?}");
    assert_eq!(r, Outcome::Cancelled);
    assert!(
        took < bound / 2,
        "the receiver waited {took:?} (bound {bound:?})"
    );
    let s = sender
        .wait(key, Role::Sender { receiver: to }, dl, None)
        .unwrap();
    assert_ne!(s, Outcome::Completed, "the bytes never reached the device");
    assert_eq!(receiver.health().buffers_leased, 0);
}

/// Staging makes device 0's context current for its copies (cudarc binds it before each call):
/// the caller's thread must have its own current context back after every call, error paths
/// included, or the caller's next CUDA runtime call goes to kvlink's context (another device's,
/// on a multi-GPU node) instead of its own.
#[test]
fn staging_leaves_the_callers_current_context_alone() {
    use cudarc::driver::{result::ctx, sys};
    if !driver_present() || CudaContext::device_count().unwrap_or(0) == 0 {
        println!("SKIP staging_leaves_the_callers_current_context_alone: no CUDA driver or GPU on this machine");
        return;
    }
    let primary = CudaContext::new(0).unwrap();
    let stream = primary.default_stream();
    let len = 1 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 11 % 253) as u8).collect();
    let d_src = stream.clone_htod(&src).unwrap();
    let d_dst = stream.alloc_zeros::<u8>(len).unwrap();
    let (src_ptr, g1) = d_src.device_ptr(&stream);
    let (dst_ptr, g2) = d_dst.device_ptr(&stream);
    stream.synchronize().unwrap();
    // A context of the caller's own on device 0 (not its primary one, which kvlink uses).
    let mut dev = 0;
    let mut own = std::ptr::null_mut();
    // SAFETY: plain driver calls with out-pointers to locals.
    unsafe {
        sys::cuDeviceGet(&mut dev, 0).result().unwrap();
        sys::cuCtxCreate_v2(&mut own, 0, dev).result().unwrap();
    }
    for want in [Some(own), None] {
        // SAFETY: `own` lives until destroyed below; null pops the thread's context stack
        // (primary, own), once per context on it.
        while ctx::get_current().unwrap() != want {
            unsafe { ctx::set_current(want.unwrap_or(std::ptr::null_mut())) }.unwrap();
        }
        let check = |after: &str| assert_eq!(ctx::get_current().unwrap(), want, "after {after}");
        let mut st = Staging::new(0, len).unwrap();
        check("Staging::new");
        st.from_device(src_ptr, len).unwrap();
        check("from_device");
        st.host_ptr().unwrap();
        check("host_ptr");
        st.host_slice(len).unwrap();
        check("host_slice");
        st.to_device(dst_ptr, len).unwrap();
        check("to_device");
        assert!(st.to_device(0x10, len).is_err(), "no allocation at 0x10");
        check("a failed to_device");
        drop(st);
        check("drop");
    }
    // SAFETY: `own` was made above and is used no more.
    unsafe { sys::cuCtxDestroy_v2(own).result().unwrap() };
    drop((g1, g2));
    assert_eq!(stream.clone_dtoh(&d_dst).unwrap(), src);
}
