//! Each process of a pair on CPUs of its own (`--pin`), the baseline's pairs and kvlink's
//! alike.
//!
//! In serving, the context and generation engines run on different hosts. On loopback the two
//! processes share this machine's cores, and on a small machine (two cores here) the kernel's
//! scheduler moves their threads across both: a kvlink process has a progress thread beside
//! its callers, `ucx_perftest` one thread, so the moves cost kvlink's rows more than the
//! baseline's and say more about the scheduler than about either (README, "Tests and
//! figures"). Pinned, the receiving side of every pair (`ucx_perftest`'s server, the
//! generation side, the transport row's receiver) gets the first half of the CPUs this process
//! may use, the sending side the second half, so that the data moves the same way across the
//! cores in every row.
use crate::cli::Pin;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The CPUs of the two sides of a pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// The receiving side's CPUs: the first half.
    pub receiver: Vec<usize>,
    /// The sending side's CPUs: the second half.
    pub sender: Vec<usize>,
}

impl Split {
    /// Halves `cpus` (in their order; the receiving side gets the odd one out); None for fewer
    /// than two.
    pub fn halve(cpus: &[usize]) -> Option<Split> {
        if cpus.len() < 2 {
            return None;
        }
        let (l, a) = cpus.split_at(cpus.len().div_ceil(2));
        Some(Split {
            receiver: l.to_vec(),
            sender: a.to_vec(),
        })
    }

    /// "0 | 1": the receiving side's CPUs, then the sending side's.
    pub fn label(&self) -> String {
        let list = |v: &[usize]| {
            v.iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        format!("{} | {}", list(&self.receiver), list(&self.sender))
    }
}

/// The split `mode` asks for: `auto` pins when this process may use two CPUs or more, `on`
/// insists (an error below two), `off` never pins.
pub fn split(mode: Pin) -> Result<Option<Split>, String> {
    if mode == Pin::Off {
        return Ok(None);
    }
    let cpus = allowed_cpus().map_err(|e| format!("--pin: the allowed CPUs: {e}"))?;
    match (Split::halve(&cpus), mode) {
        (None, Pin::On) => Err(format!(
            "--pin on needs two CPUs or more; this process may use {}",
            cpus.len()
        )),
        (s, _) => Ok(s),
    }
}

/// The label a run's header and JSON give its pinning.
pub fn label(split: Option<&Split>) -> String {
    split.map_or_else(|| "off".into(), Split::label)
}

/// Makes `cmd`'s process run on `cpus` only.
pub fn apply(cmd: &mut Command, cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes within it (the ids come from
    // sched_getaffinity of this process, so they fit). Built here, before the fork: the closure
    // only calls sched_setaffinity, which is async-signal-safe.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        set
    };
    // SAFETY: see above; the closure touches nothing but its own copy of `set`.
    unsafe {
        cmd.pre_exec(move || {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills at most its size.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        set
    };
    // SAFETY: CPU_ISSET reads within the set for every id below CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_side_gets_the_first_half_and_the_odd_one_out() {
        assert_eq!(Split::halve(&[3]), None, "one CPU cannot be split");
        let two = Split::halve(&[0, 1]).unwrap();
        assert_eq!((two.receiver, two.sender), (vec![0], vec![1]));
        let five = Split::halve(&[0, 2, 4, 6, 8]).unwrap();
        assert_eq!(five.label(), "0,2,4 | 6,8");
        assert_eq!(label(None), "off");
    }

    #[test]
    fn a_pinned_child_runs_on_its_cpus_only() {
        let cpus = allowed_cpus().unwrap();
        assert!(!cpus.is_empty(), "this process runs somewhere");
        let Some(s) = Split::halve(&cpus) else {
            eprintln!("skipped: this machine lets the test use one CPU, nothing to split");
            return;
        };
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "grep Cpus_allowed_list /proc/self/status"]);
        apply(&mut cmd, &s.sender);
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let list = text.split(':').nth(1).unwrap().trim().to_string();
        let mut seen = Vec::new();
        for part in list.split(',') {
            match part.split_once('-') {
                Some((a, b)) => seen.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
                None => seen.push(part.parse().unwrap()),
            }
        }
        assert_eq!(seen, s.sender, "the child's allowed CPUs: {list}");
    }

    #[test]
    fn off_never_pins_and_auto_pins_where_it_can() {
        assert_eq!(split(Pin::Off), Ok(None));
        let cpus = allowed_cpus().unwrap();
        assert_eq!(split(Pin::Auto), Ok(Split::halve(&cpus)));
        assert_eq!(split(Pin::On).is_ok(), cpus.len() >= 2);
    }
}
