//! The address a listening engine tells its peers. A listener bound to the wildcard `0.0.0.0`
//! accepts on every interface, but `0.0.0.0:port` is no address another host can dial: there it
//! means that host itself. [`published`] puts an address of one of this host's interfaces in its
//! place, chosen by the transport's network devices where they name one.
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// One IPv4 address of a network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Iface {
    pub name: String,
    pub ip: Ipv4Addr,
    /// Up and with a carrier (`IFF_UP` and `IFF_RUNNING`, UCX's own test of an active
    /// interface): one that is up with its cable out, or a bridge with nothing attached
    /// (`docker0`), carries nothing to this host.
    pub up: bool,
    pub loopback: bool,
}

/// Where peers reach a listener bound at `bound`: `bound` itself unless its ip is the wildcard;
/// then the ip [`choose`] picks among `ifaces` (this host's, [`interfaces`]) for `devices` (the
/// `UCX_NET_DEVICES`-style list the engine runs with), and the interface it came from.
pub(crate) fn published(
    bound: SocketAddr,
    devices: Option<&str>,
    ifaces: &[Iface],
) -> (SocketAddr, Option<String>) {
    if !bound.ip().is_unspecified() {
        return (bound, None);
    }
    let (ip, from) = match choose(ifaces, devices) {
        Some(i) => (i.ip, Some(i.name)),
        None => (Ipv4Addr::LOCALHOST, None),
    };
    (SocketAddr::new(IpAddr::V4(ip), bound.port()), from)
}

/// A `UCX_NET_DEVICES`-style list as it concerns network interfaces: device names, a UCX
/// `device:port` suffix dropped.
enum Devices {
    /// None given, empty, or `all`.
    All,
    /// `eth0`, `ib0,eth1`: these, in this order.
    Only(Vec<String>),
    /// `^eth1,docker0`: all but these.
    Except(Vec<String>),
}

impl Devices {
    fn parse(devices: Option<&str>) -> Devices {
        let names = |list: &str| -> Vec<String> {
            list.split(',')
                .map(|d| d.trim().split(':').next().unwrap_or("").to_string())
                .filter(|d| !d.is_empty())
                .collect()
        };
        match devices.map(str::trim).filter(|d| !d.is_empty()) {
            None | Some("all") => Devices::All,
            Some(s) => match s.strip_prefix('^') {
                Some(rest) => Devices::Except(names(rest)),
                None => Devices::Only(names(s)),
            },
        }
    }

    /// Whether the list takes the device `i` is on.
    fn admits(&self, i: &Iface) -> bool {
        match self {
            Devices::All => true,
            Devices::Only(names) => names.contains(&i.device()),
            Devices::Except(names) => !names.contains(&i.device()),
        }
    }
}

impl Iface {
    /// The device this address is on: an address with a label (`eth0:1`, an alias) is on its
    /// device (`eth0`), as UCX names it.
    fn device(&self) -> String {
        self.name.split(':').next().unwrap_or("").to_string()
    }
}

/// The interface whose address a wildcard listener publishes, or None when this host has no
/// IPv4 interface that is up (then only this host can reach it, at 127.0.0.1).
///
/// - `devices` naming interfaces (`eth0`, `ib0,eth1`; a UCX `device:port` suffix is ignored):
///   the first of them, in the list's order, that is up with an IPv4 address (an alias such as
///   `eth0:1` counts as its device's), loopback too when named (`lo`). If none of them has one,
///   the choice below, as if no devices were named.
/// - No devices, `all`, or an exclusion (`^eth1,docker0`): the first interface in the system's
///   order that is up, not excluded, not loopback and not link-local (`169.254/16`); failing that
///   a link-local one, failing that loopback.
pub(crate) fn choose(ifaces: &[Iface], devices: Option<&str>) -> Option<Iface> {
    let up = || ifaces.iter().filter(|i| i.up);
    let mut spec = Devices::parse(devices);
    if let Devices::Only(names) = &spec {
        for name in names {
            if let Some(i) = up().find(|i| i.device() == *name) {
                return Some(i.clone());
            }
        }
        spec = Devices::All;
    }
    let allowed = || up().filter(|i| spec.admits(i));
    let link_local = |i: &&Iface| i.ip.is_link_local();
    allowed()
        .find(|i| !i.loopback && !link_local(i))
        .or_else(|| allowed().find(|i| !i.loopback))
        .or_else(|| allowed().find(|i| i.loopback))
        .cloned()
}

/// For a tcp engine listening at one of this host's addresses: the interface that address is
/// on, when the transport's devices leave it out (`tcp@lo` listening at eth0's address, or
/// `tcp@eth0` at 127.0.0.1). Such a listener accepts, but UCX then has no tcp lane between the
/// two ends and every peer's connection fails. None when the address is the wildcard, is not
/// this host's (the bind reports that), or is on a device the list takes.
pub(crate) fn listen_outside_devices(
    listen: SocketAddr,
    devices: Option<&str>,
    ifaces: &[Iface],
) -> Option<String> {
    let spec = Devices::parse(devices);
    ifaces
        .iter()
        .find(|i| IpAddr::V4(i.ip) == listen.ip())
        .filter(|i| !spec.admits(i))
        .map(|i| i.name.clone())
}

/// This host's IPv4 interface addresses, in the system's order (`getifaddrs`); empty if it
/// cannot be read.
pub(crate) fn interfaces() -> Vec<Iface> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut at = head;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr whose family says its real type.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        let flags = ifa.ifa_flags as libc::c_int;
        let active = libc::IFF_UP | libc::IFF_RUNNING;
        out.push(Iface {
            name: name.to_string_lossy().into_owned(),
            ip: Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
            up: flags & active == active,
            loopback: flags & libc::IFF_LOOPBACK != 0,
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, ip: &str, up: bool) -> Iface {
        Iface {
            name: name.into(),
            ip: ip.parse().unwrap(),
            up,
            loopback: name == "lo",
        }
    }

    fn host() -> Vec<Iface> {
        vec![
            iface("lo", "127.0.0.1", true),
            iface("eth0", "10.0.0.5", true),
            iface("eth1", "192.168.7.5", true),
            iface("down0", "10.9.9.9", false),
            iface("ll0", "169.254.3.3", true),
        ]
    }

    fn pick(ifaces: &[Iface], devices: Option<&str>) -> Option<String> {
        choose(ifaces, devices).map(|i| i.ip.to_string())
    }

    #[test]
    fn without_devices_the_first_routable_interface_that_is_up() {
        assert_eq!(pick(&host(), None).as_deref(), Some("10.0.0.5"));
        assert_eq!(pick(&host(), Some("all")).as_deref(), Some("10.0.0.5"));
        assert_eq!(pick(&host(), Some("  ")).as_deref(), Some("10.0.0.5"));
    }

    #[test]
    fn named_devices_are_taken_in_their_order_loopback_included() {
        assert_eq!(pick(&host(), Some("eth1")).as_deref(), Some("192.168.7.5"));
        assert_eq!(
            pick(&host(), Some("down0,eth1,eth0")).as_deref(),
            Some("192.168.7.5"),
            "a device that is down is passed over"
        );
        assert_eq!(pick(&host(), Some("lo")).as_deref(), Some("127.0.0.1"));
        assert_eq!(
            pick(&host(), Some("eth1:1")).as_deref(),
            Some("192.168.7.5"),
            "a UCX port suffix"
        );
        assert_eq!(
            pick(&host(), Some("mlx5_0:1")).as_deref(),
            Some("10.0.0.5"),
            "a device with no IPv4 address: as if none were named"
        );
    }

    #[test]
    fn an_aliased_address_belongs_to_its_device() {
        let mut h = host();
        h.insert(2, iface("eth0:1", "10.0.1.5", true));
        assert_eq!(pick(&h, Some("^eth0")).as_deref(), Some("192.168.7.5"));
        assert_eq!(pick(&h, Some("eth0")).as_deref(), Some("10.0.0.5"));
        h.remove(1);
        assert_eq!(pick(&h, Some("eth0")).as_deref(), Some("10.0.1.5"));
    }

    #[test]
    fn a_listen_address_outside_the_devices_is_named() {
        let at = |a: &str, d: &str| listen_outside_devices(a.parse().unwrap(), Some(d), &host());
        assert_eq!(at("10.0.0.5:1", "lo").as_deref(), Some("eth0"));
        assert_eq!(at("127.0.0.1:1", "eth0").as_deref(), Some("lo"));
        assert_eq!(at("10.0.0.5:1", "^eth0").as_deref(), Some("eth0"));
        assert_eq!(at("10.0.0.5:1", "eth1,eth0:1"), None, "listed");
        assert_eq!(at("10.0.0.5:1", "^eth1"), None, "not excluded");
        assert_eq!(at("10.0.0.5:1", "all"), None);
        assert_eq!(
            at("10.1.1.1:1", "lo"),
            None,
            "not this host's: the bind says so"
        );
        let wildcard = "0.0.0.0:1".parse().unwrap();
        assert_eq!(listen_outside_devices(wildcard, Some("lo"), &host()), None);
    }

    #[test]
    fn an_exclusion_passes_over_its_devices() {
        assert_eq!(pick(&host(), Some("^eth0")).as_deref(), Some("192.168.7.5"));
        assert_eq!(
            pick(&host(), Some("^eth0,eth1")).as_deref(),
            Some("169.254.3.3"),
            "link-local before loopback"
        );
        assert_eq!(
            pick(&host(), Some("^eth0,eth1,ll0")).as_deref(),
            Some("127.0.0.1")
        );
    }

    #[test]
    fn a_host_with_loopback_only_or_nothing_up() {
        let only_lo = vec![
            iface("lo", "127.0.0.1", true),
            iface("eth0", "10.0.0.5", false),
        ];
        assert_eq!(pick(&only_lo, None).as_deref(), Some("127.0.0.1"));
        assert_eq!(pick(&[], None), None);
        let (a, from) = published("0.0.0.0:7000".parse().unwrap(), None, &interfaces());
        assert_eq!(a.port(), 7000);
        assert!(!a.ip().is_unspecified(), "{a} from {from:?}");
    }

    #[test]
    fn a_bound_address_is_published_as_it_is() {
        let bound: SocketAddr = "10.1.2.3:4567".parse().unwrap();
        assert_eq!(published(bound, Some("eth0"), &host()), (bound, None));
    }
}
