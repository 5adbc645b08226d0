//! `kvlink-bench copy`: this machine's memory copy rate into one buffer against several used
//! in turn, in this one process, no transport.
//!
//! Every byte kvlink moves over tcp or shared memory is copied by a CPU (the kernel's socket
//! copies, or UCX's shared-memory copies), so where the destination lies matters as much as
//! the protocol. `ucx_perftest` keeps one buffer of the message size per thread whatever `-O N`
//! says: its N outstanding operations all land in the same bytes, which stay in cache. N
//! requests in flight need N buffers, so each copy writes memory last touched N transfers
//! ago; once N times the size passes the last-level cache, every copy goes to DRAM. This
//! prints the copy rate (one hot source, destinations used in turn) for each count, so that an
//! in-flight row can be read against what the memory allows on the same host.
use crate::cli::CopyArgs;
use crate::hugebuf::HugeBuf;
use std::time::Instant;

pub fn run(a: &CopyArgs) -> i32 {
    let Ok(size) = usize::try_from(a.size) else {
        eprintln!("kvlink-bench copy: size too large");
        return 2;
    };
    if size == 0 || a.buffers.contains(&0) {
        eprintln!("kvlink-bench copy: the size and every buffer count must be at least 1");
        return 2;
    }
    let mut src = HugeBuf::zeroed(size);
    src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let mut rows = Vec::new();
    for &n in &a.buffers {
        let copies = copies_per_round(size, n);
        let mut dsts: Vec<HugeBuf> = (0..n).map(|_| HugeBuf::zeroed(size)).collect();
        let mut gbps = Vec::new();
        for round in 0..=a.rounds {
            let t0 = Instant::now();
            for i in 0..copies {
                dsts[i % n].copy_from_slice(&src);
                // The source changes a little between copies, so no copy can be skipped.
                src[i % size] = src[i % size].wrapping_add(1);
            }
            let dt = t0.elapsed().as_secs_f64();
            // Round 0 faults the buffers in and warms the caches: not counted.
            if round > 0 {
                gbps.push((copies * size) as f64 / dt / 1e9);
            }
            std::hint::black_box(&dsts);
        }
        gbps.sort_by(f64::total_cmp);
        let median = gbps[gbps.len() / 2];
        println!(
            "copy {size} bytes into {n} buffer(s) in turn: {median:.2} GB/s (median of {} rounds, \
             {:.2}-{:.2})",
            gbps.len(),
            gbps[0],
            gbps[gbps.len() - 1]
        );
        rows.push(
            serde_json::json!({"size": size, "buffers": n, "median_gbps": median,
            "min_gbps": gbps[0], "max_gbps": gbps[gbps.len() - 1], "copies_per_round": copies}),
        );
    }
    println!("COPY {}", serde_json::Value::Array(rows));
    0
}

/// At least 256 MiB copied per round, at least 100 copies, and every buffer written.
fn copies_per_round(size: usize, buffers: usize) -> usize {
    ((256usize << 20) / size).max(100).max(buffers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_measures_each_count_and_refuses_empty_sizes_and_counts() {
        let a = |size, buffers: &[usize]| CopyArgs {
            size,
            buffers: buffers.to_vec(),
            rounds: 1,
        };
        assert_eq!(run(&a(4096, &[1, 3])), 0);
        assert_eq!(run(&a(0, &[1])), 2);
        assert_eq!(run(&a(4096, &[1, 0])), 2);
    }

    #[test]
    fn a_round_writes_every_buffer_and_enough_bytes() {
        assert_eq!(copies_per_round(1 << 20, 8), 256);
        assert_eq!(copies_per_round(64 << 20, 1), 100);
        assert_eq!(copies_per_round(16 << 20, 128), 128);
        assert_eq!(copies_per_round(4096, 4096), 65536);
    }
}
