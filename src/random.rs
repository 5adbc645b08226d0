//! Randomness from the operating system, for what must not be guessed: receive-token keys,
//! instance nonces and handshake challenges.
use std::io::Read;

/// Fills `buf` from the kernel's random source (`getrandom(2)`, else `/dev/urandom`). Falls back
/// to the standard library's randomly keyed hasher, with a warning, only where neither works.
pub(crate) fn fill(buf: &mut [u8]) {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: writes at most rest.len() bytes into rest.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n > 0 {
            done += n as usize;
            continue;
        }
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        break;
    }
    if done == buf.len() {
        return;
    }
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf[done..]))
        .is_ok()
    {
        return;
    }
    tracing::warn!("no kernel randomness: tokens and challenges from the std hasher's keys");
    use std::hash::{BuildHasher, Hasher};
    for chunk in buf[done..].chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(chunk.as_ptr() as usize);
        let v = h.finish().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

pub(crate) fn u64() -> u64 {
    let mut b = [0u8; 8];
    fill(&mut b);
    u64::from_le_bytes(b)
}

pub(crate) fn key16() -> [u8; 16] {
    let mut b = [0u8; 16];
    fill(&mut b);
    b
}

#[cfg(test)]
mod tests {
    #[test]
    fn draws_differ() {
        let a: Vec<u64> = (0..8).map(|_| super::u64()).collect();
        let mut b = a.clone();
        b.dedup();
        assert_eq!(a.len(), b.len(), "{a:?}");
        assert_ne!(super::key16(), super::key16());
    }
}
