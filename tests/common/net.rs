//! Two network namespaces joined by a veth pair: the project's own test hosts, created and
//! removed by the test. Needs root (CI runs as root); elsewhere `setup` prints why it skips.
use std::process::{Command, Stdio};

pub fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Two namespaces `a` and `b` joined by veth, with 10.77.<n>.1 and 10.77.<n>.2.
pub struct Net {
    pub a: String,
    pub b: String,
    pub ip_a: String,
    pub ip_b: String,
    /// The veth ends inside `a` and `b`.
    pub dev_a: String,
    pub dev_b: String,
}

impl Net {
    pub fn new(tag: &str) -> Option<Net> {
        let n = (std::process::id() + tag.bytes().map(u32::from).sum::<u32>()) % 200;
        let (a, b) = (format!("kvl{tag}a{n}"), format!("kvl{tag}b{n}"));
        let (va, vb) = (format!("kv{tag}{n}a"), format!("kv{tag}{n}b"));
        let (ip_a, ip_b) = (format!("10.77.{n}.1"), format!("10.77.{n}.2"));
        let _ = sh(&["ip", "netns", "del", &a]);
        let _ = sh(&["ip", "netns", "del", &b]);
        let ok = sh(&["ip", "netns", "add", &a])
            && sh(&["ip", "netns", "add", &b])
            && sh(&[
                "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
            ])
            && sh(&["ip", "link", "set", &va, "netns", &a])
            && sh(&["ip", "link", "set", &vb, "netns", &b])
            && sh(&[
                "ip",
                "-n",
                &a,
                "addr",
                "add",
                &format!("{ip_a}/24"),
                "dev",
                &va,
            ])
            && sh(&[
                "ip",
                "-n",
                &b,
                "addr",
                "add",
                &format!("{ip_b}/24"),
                "dev",
                &vb,
            ])
            && sh(&["ip", "-n", &a, "link", "set", &va, "up"])
            && sh(&["ip", "-n", &b, "link", "set", &vb, "up"])
            && sh(&["ip", "-n", &a, "link", "set", "lo", "up"])
            && sh(&["ip", "-n", &b, "link", "set", "lo", "up"]);
        let net = Net {
            a,
            b,
            ip_a,
            ip_b,
            dev_a: va,
            dev_b: vb,
        };
        ok.then_some(net)
    }
    /// Cuts `b` off (`on`: everything into and out of its namespace dropped, no RST, no FIN) or
    /// heals the cut; true if iptables took both rules.
    pub fn partition(&self, on: bool) -> bool {
        let op = if on { "-I" } else { "-D" };
        self.iptables_b(&[op, "INPUT", "-j", "DROP"])
            && self.iptables_b(&[op, "OUTPUT", "-j", "DROP"])
    }

    pub fn iptables_b(&self, rule: &[&str]) -> bool {
        let mut args = vec!["ip", "netns", "exec", &self.b, "iptables"];
        args.extend_from_slice(rule);
        sh(&args)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.a]);
        let _ = sh(&["ip", "netns", "del", &self.b]);
    }
}

pub fn skip(why: &str) {
    println!("SKIP: {why}");
}

pub fn setup(tag: &str) -> Option<Net> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("network namespaces need root");
        return None;
    }
    let net = Net::new(tag);
    if net.is_none() {
        skip("could not create network namespaces and a veth pair (ip netns / veth unavailable)");
    }
    net
}
