//! The bytes `kvlink-engine-peer` sends for (request, segment), and their check: one source
//! for the helper (src/bin/kvlink-engine-peer.rs) and the tests that check what it sent
//! (`#[path]`-included by both).
#![allow(dead_code)]

/// Word `i` of the block that (request, segment)'s bytes repeat: deterministic, so the
/// receiver checks every byte.
pub fn word(request: u64, segment: u32, i: usize) -> u64 {
    let mut x = request.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (u64::from(segment) << 40)
        ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x
}

/// Words in the block a segment's bytes repeat. Prime, so that data landing at a shifted
/// offset (a power of two, a segment or a page off) never lines up with the block; and each
/// block's first word is its own (`word` past the block, by the block's number), so that a
/// block landing in another block's place does not pass either. Filling and checking are then
/// a memcpy and a memcmp per block: 128 MiB in tens of milliseconds even in an unoptimised,
/// sanitized build, where a word at a time took seconds inside timed windows.
pub const BLOCK_WORDS: usize = 8191;

fn block(request: u64, segment: u32) -> Vec<u8> {
    (0..BLOCK_WORDS)
        .flat_map(|i| word(request, segment, i).to_le_bytes())
        .collect()
}

/// The first word of block `k`.
fn head(request: u64, segment: u32, k: usize) -> [u8; 8] {
    word(request, segment, BLOCK_WORDS + k).to_le_bytes()
}

pub fn fill(request: u64, segment: u32, buf: &mut [u8]) {
    let b = block(request, segment);
    for (k, c) in buf.chunks_mut(b.len()).enumerate() {
        c.copy_from_slice(&b[..c.len()]);
        if c.len() >= 8 {
            c[..8].copy_from_slice(&head(request, segment, k));
        }
    }
}

pub fn intact(request: u64, segment: u32, buf: &[u8]) -> bool {
    let b = block(request, segment);
    buf.chunks(b.len()).enumerate().all(|(k, c)| {
        if c.len() >= 8 {
            c[..8] == head(request, segment, k) && c[8..] == b[8..c.len()]
        } else {
            c == &b[..c.len()]
        }
    })
}
