//! A worker address as kvlink hands it out: UCX's packed address, sealed with its length and a
//! checksum, so that one that was cut short, mistyped or made up is refused here as
//! `InvalidArgument` instead of reaching `ucp_ep_create`. UCX unpacks what it is given without
//! bounds and asserts on what it cannot read: an address of 0xff bytes aborts the process inside
//! `ucp_address_unpack` (UCX 1.13, "addr version 15"), and a peer's `Bind` carries its address
//! before any handshake. A checksum is no defence against a forger (docs/SECURITY.md); it keeps
//! accidents and foreign bytes away from UCX.
//!
//! Layout: `MAGIC` (4 bytes), the address's length (u32, little-endian), its FNV-1a 64-bit hash
//! (u64, little-endian), then the address.
//!
//! Kept in the protocol core, beside the wire codec, so that the fuzz targets reach [`open`]:
//! the transport (`transport::ucx::address`) seals its worker's address and opens a peer's.
//!
//! A packed remote key (`ucp_rkey_pack`) is sealed alike, under its own magic ([`seal_rkey`],
//! [`open_rkey`]): `ucp_ep_rkey_unpack` takes no length either, and reads whatever the bytes
//! say is there.
use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"KVW1";
const RKEY_MAGIC: [u8; 4] = *b"KVR1";
const HEADER: usize = 4 + 4 + 8;

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// UCX's address `raw`, sealed.
pub fn seal(raw: &[u8]) -> Vec<u8> {
    seal_as(MAGIC, raw)
}

/// UCX's address inside `sealed`, or `InvalidArgument` if `sealed` is not one [`seal`] made
/// (whole and unchanged).
pub fn open(sealed: &[u8]) -> Result<&[u8]> {
    open_as(MAGIC, "worker address", sealed)
}

/// UCX's packed remote key `raw`, sealed.
pub fn seal_rkey(raw: &[u8]) -> Vec<u8> {
    seal_as(RKEY_MAGIC, raw)
}

/// The packed remote key inside `sealed`, or `InvalidArgument` if `sealed` is not one
/// [`seal_rkey`] made (whole and unchanged; a sealed worker address is not one).
pub fn open_rkey(sealed: &[u8]) -> Result<&[u8]> {
    open_as(RKEY_MAGIC, "remote key", sealed)
}

fn seal_as(magic: [u8; 4], raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + raw.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&fnv1a64(raw).to_le_bytes());
    out.extend_from_slice(raw);
    out
}

fn open_as<'a>(magic: [u8; 4], what: &str, sealed: &'a [u8]) -> Result<&'a [u8]> {
    let bad = |why: &str| Error::invalid(format!("not a kvlink {what}: {why}"));
    if sealed.len() <= HEADER || sealed[..4] != magic {
        return Err(bad("no header"));
    }
    let len = u32::from_le_bytes(sealed[4..8].try_into().unwrap()) as usize;
    let sum = u64::from_le_bytes(sealed[8..16].try_into().unwrap());
    let raw = &sealed[HEADER..];
    if raw.len() != len {
        return Err(bad("cut short or overlong"));
    }
    if fnv1a64(raw) != sum {
        return Err(bad("its checksum does not match"));
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_seal_made_opens() {
        let raw: Vec<u8> = (0..200u32).map(|i| (i * 7) as u8).collect();
        let s = seal(&raw);
        assert_eq!(open(&s).unwrap(), &raw[..]);
        // Cut, extended, any byte changed, bare UCX bytes, nothing.
        assert!(open(&s[..s.len() - 1]).is_err());
        let mut longer = s.clone();
        longer.push(0);
        assert!(open(&longer).is_err());
        for i in 0..s.len() {
            let mut t = s.clone();
            t[i] ^= 0x20;
            assert!(open(&t).is_err(), "byte {i} changed");
        }
        assert!(open(&raw).is_err());
        assert!(open(&[0xff; 100]).is_err());
        assert!(open(&[]).is_err());
        assert!(open(&s[..HEADER]).is_err());
    }

    /// A remote key opens only as one: not as a worker address, nor an address as a key.
    #[test]
    fn a_sealed_remote_key_is_not_a_worker_address() {
        let raw = [7u8; 40];
        let key = seal_rkey(&raw);
        assert_eq!(open_rkey(&key).unwrap(), &raw[..]);
        assert!(open(&key).is_err());
        assert!(open_rkey(&seal(&raw)).is_err());
        assert!(open_rkey(&key[..key.len() - 1]).is_err());
        assert!(open_rkey(&[0xff]).is_err());
    }
}
