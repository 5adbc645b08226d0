//! Whether the kernel paced a row's tcp sockets: the machine's `HRTIMER` softirqs over the row.
//!
//! Under BBR (this host's `net.ipv4.tcp_congestion_control`) the kernel paces each tcp socket
//! itself, loopback included (`lo` has no `fq` qdisc to do it): a send that would run ahead of
//! the socket's pacing rate arms a timer, `tcp_pace_kick`, which fires in the `HRTIMER`
//! softirq. Whether a connection ever runs into its pacing rate is decided by its own bandwidth
//! estimate, which differs from connection to connection: at 16 MiB over loopback the same
//! pair is fast in some runs and a third slower in others, `ucx_perftest`'s as kvlink's, and
//! the slow runs are the ones with thousands of these kicks (`perf record -e
//! timer:hrtimer_expire_entry`: every `HRTIMER` softirq of such a row was `tcp_pace_kick`; a
//! fast run has none). An idle machine counts none either, so the machine-wide count over a
//! row is that row's pacing, give or take a few.

/// The `HRTIMER` softirqs handled so far, all CPUs summed; None if `/proc/softirqs` cannot be
/// read (not Linux) or has no such line.
pub fn hrtimer_softirqs() -> Option<u64> {
    parse(&std::fs::read_to_string("/proc/softirqs").ok()?)
}

fn parse(softirqs: &str) -> Option<u64> {
    let line = softirqs
        .lines()
        .find(|l| l.trim_start().starts_with("HRTIMER:"))?;
    let counts = line.split_once(':')?.1.split_whitespace();
    counts.map(|c| c.parse::<u64>().ok()).sum()
}

/// The host's tcp congestion control (`net.ipv4.tcp_congestion_control`), if readable.
pub fn congestion_control() -> Option<String> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").ok()?;
    Some(s.trim().to_string()).filter(|s| !s.is_empty())
}

/// From this many kicks in a row on, the table says the row was paced. Unpaced rows count 0 to
/// a dozen; a 16 MiB row that ran a third slower, thousands (800-1300 left it as fast).
pub const PACED: u64 = 1000;

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "                    CPU0       CPU1
          HI:          1          0
       TIMER:    1047315     977823
      NET_RX:   29165853   27140014
     HRTIMER:    6799681   10547012
         RCU:    3497123    3347797
";

    #[test]
    fn the_hrtimer_line_is_summed_over_the_cpus() {
        assert_eq!(parse(SAMPLE), Some(6_799_681 + 10_547_012));
    }

    #[test]
    fn a_table_without_the_line_or_with_a_bad_count_gives_none() {
        assert_eq!(parse("  CPU0\n  TIMER: 5\n"), None);
        assert_eq!(parse("  CPU0 CPU1\n  HRTIMER: 5 x\n"), None);
    }

    #[test]
    fn this_machine_has_the_count_where_it_runs_linux() {
        if cfg!(target_os = "linux") {
            assert!(hrtimer_softirqs().is_some());
        }
    }
}
