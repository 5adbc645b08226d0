//! What the linked UCX has: its transports and devices (asked of UCT, once per process), and the
//! check of a transport setting against them. UCX itself only warns about a transport name it
//! does not know (and fails later, if nothing is left, with "no such device"); kvlink refuses
//! such a setting at once, with `InvalidArgument` naming the word that was wrong.
use super::sys;
use crate::error::{Error, Result};
use std::os::raw::{c_char, c_uint, c_void};
use std::sync::OnceLock;

/// One transport on one device, as UCT lists it (`ucx_info -d` shows the same).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlResource {
    pub tl: String,
    pub dev: String,
    /// A network device (the kind `UCX_NET_DEVICES` selects among).
    pub net: bool,
}

/// Transport names and aliases UCX accepts in `UCX_TLS` (from its documentation), whether or
/// not this build or machine has them, with the transports each stands for. A name here that
/// the linked UCX lacks is "not available here", not "unknown".
const KNOWN: &[(&str, &[&str])] = &[
    ("all", &[]),
    ("sm", &["posix", "sysv", "cma", "knem", "xpmem"]),
    ("shm", &["posix", "sysv", "cma", "knem", "xpmem"]),
    ("mm", &["posix", "sysv", "xpmem"]),
    (
        "ib",
        &["rc_verbs", "rc_mlx5", "ud_verbs", "ud_mlx5", "dc_mlx5"],
    ),
    ("rc", &["rc_verbs", "rc_mlx5"]),
    ("rc_v", &["rc_verbs"]),
    ("rc_x", &["rc_mlx5"]),
    ("ud", &["ud_verbs", "ud_mlx5"]),
    ("ud_v", &["ud_verbs"]),
    ("ud_x", &["ud_mlx5"]),
    ("dc", &["dc_mlx5"]),
    ("dc_x", &["dc_mlx5"]),
    ("cuda", &["cuda_copy", "cuda_ipc", "gdr_copy"]),
    ("rocm", &["rocm_copy", "rocm_ipc", "rocm_gdr"]),
    ("ugni", &["ugni_rdma", "ugni_udt", "ugni_smsg"]),
    ("self", &["self"]),
    ("tcp", &["tcp"]),
    ("posix", &["posix"]),
    ("sysv", &["sysv"]),
    ("cma", &["cma"]),
    ("knem", &["knem"]),
    ("xpmem", &["xpmem"]),
    ("rc_verbs", &["rc_verbs"]),
    ("rc_mlx5", &["rc_mlx5"]),
    ("ud_verbs", &["ud_verbs"]),
    ("ud_mlx5", &["ud_mlx5"]),
    ("dc_mlx5", &["dc_mlx5"]),
    ("srd", &["srd"]),
    ("cuda_copy", &["cuda_copy"]),
    ("cuda_ipc", &["cuda_ipc"]),
    ("gdr_copy", &["gdr_copy"]),
    ("rocm_copy", &["rocm_copy"]),
    ("rocm_ipc", &["rocm_ipc"]),
    ("rocm_gdr", &["rocm_gdr"]),
    ("ze_copy", &["ze_copy"]),
    ("ze_ipc", &["ze_ipc"]),
    ("ze_gdr", &["ze_gdr"]),
    ("ugni_rdma", &["ugni_rdma"]),
    ("ugni_udt", &["ugni_udt"]),
    ("ugni_smsg", &["ugni_smsg"]),
];

fn cstr(bytes: &[c_char]) -> String {
    let b: Vec<u8> = bytes
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&b).into_owned()
}

/// The linked UCX's transports and devices, asked once per process.
pub fn resources() -> Result<&'static [TlResource]> {
    static CACHE: OnceLock<std::result::Result<Vec<TlResource>, String>> = OnceLock::new();
    CACHE
        .get_or_init(|| query().map_err(|e| e.message))
        .as_deref()
        .map_err(|m| Error::new(crate::error::ErrorKind::Transport, m.clone()))
}

/// Every component's memory domains, and every transport resource of each (UCT's own listing).
fn query() -> Result<Vec<TlResource>> {
    let mut out = Vec::new();
    let mut comps: *mut sys::uct_component_h = std::ptr::null_mut();
    let mut ncomps: c_uint = 0;
    // SAFETY: out-pointers are valid; the list is released below.
    let st = unsafe { sys::uct_query_components(&mut comps, &mut ncomps) };
    if st != sys::UCS_OK {
        return Err(super::ucx_err(st, "uct_query_components"));
    }
    for i in 0..ncomps as usize {
        // SAFETY: UCX returned `ncomps` component handles at `comps`.
        let comp = unsafe { *comps.add(i) };
        let mut attr = sys::uct_component_attr_t {
            field_mask: sys::UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT as u64,
            ..Default::default()
        };
        // SAFETY: attr names the one field asked for.
        if unsafe { sys::uct_component_query(comp, &mut attr) } != sys::UCS_OK {
            continue;
        }
        let mut mds = vec![sys::uct_md_resource_desc_t::default(); attr.md_resource_count as usize];
        attr.field_mask = sys::UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES as u64;
        attr.md_resources = mds.as_mut_ptr();
        // SAFETY: md_resources has room for md_resource_count entries.
        if mds.is_empty() || unsafe { sys::uct_component_query(comp, &mut attr) } != sys::UCS_OK {
            continue;
        }
        for md in &mds {
            // SAFETY: each call gets valid pointers; what is opened is closed/released here.
            unsafe { md_resources(comp, md, &mut out) };
        }
    }
    // SAFETY: the list from uct_query_components, released once.
    unsafe { sys::uct_release_component_list(comps) };
    Ok(out)
}

/// # Safety
/// `comp` must be a component handle from `uct_query_components`, not yet released.
unsafe fn md_resources(
    comp: sys::uct_component_h,
    md: &sys::uct_md_resource_desc_t,
    out: &mut Vec<TlResource>,
) {
    let mut cfg: *mut sys::uct_md_config_t = std::ptr::null_mut();
    // SAFETY: null prefix and file mean "UCX_ environment", as UCP reads it.
    if unsafe { sys::uct_md_config_read(comp, std::ptr::null(), std::ptr::null(), &mut cfg) }
        != sys::UCS_OK
    {
        return;
    }
    let mut mdh: sys::uct_md_h = std::ptr::null_mut();
    // SAFETY: md_name is NUL-terminated (UCX wrote it); cfg is released right after.
    let st = unsafe { sys::uct_md_open(comp, md.md_name.as_ptr(), cfg, &mut mdh) };
    // SAFETY: the config from uct_md_config_read, released once.
    unsafe { sys::uct_config_release(cfg as *mut c_void) };
    if st != sys::UCS_OK {
        return;
    }
    let mut res: *mut sys::uct_tl_resource_desc_t = std::ptr::null_mut();
    let mut nres: c_uint = 0;
    // SAFETY: mdh is open; the list is released below.
    if unsafe { sys::uct_md_query_tl_resources(mdh, &mut res, &mut nres) } == sys::UCS_OK {
        for j in 0..nres as usize {
            // SAFETY: UCX returned `nres` descriptors at `res`.
            let r = unsafe { &*res.add(j) };
            out.push(TlResource {
                tl: cstr(&r.tl_name),
                dev: cstr(&r.dev_name),
                net: r.dev_type == sys::UCT_DEVICE_TYPE_NET,
            });
        }
        // SAFETY: released once.
        unsafe { sys::uct_release_tl_resource_list(res) };
    }
    // SAFETY: closed once, after its resource list was released.
    unsafe { sys::uct_md_close(mdh) };
}

/// The linked UCX's version, as its library reports it.
pub fn ucx_version() -> String {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: out-pointers to three u32s.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    format!("{major}.{minor}.{release}")
}

/// The linked UCX's minor version (13 for 1.13.1).
pub fn ucx_minor() -> u32 {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: out-pointers to three u32s.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    minor
}

fn names(list: &[String]) -> String {
    let mut v = list.to_vec();
    v.sort();
    v.dedup();
    v.join(", ")
}

/// Checks a `UCX_TLS`-style list (`rc,cuda_copy`, `^cma`, `tcp,self`) against `have`. A word UCX
/// does not know is refused; so is a list none of whose transports (other than `self`, which
/// reaches only its own process) the linked UCX has. Known transports it lacks are returned, to
/// be logged: UCX uses the rest.
pub fn check_tls(list: &str, have: &[TlResource]) -> Result<Vec<String>> {
    let version = ucx_version_for_messages();
    let available: Vec<String> = have.iter().map(|r| r.tl.clone()).collect();
    let (negated, body) = match list.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, list),
    };
    let mut missing = Vec::new();
    let mut reachable = false;
    for word in body.split(',') {
        let name = word.strip_suffix(":aux").unwrap_or(word);
        if name.is_empty() {
            return Err(Error::invalid(format!(
                "transport list '{list}' has an empty entry"
            )));
        }
        let members: Vec<&str> = if available.iter().any(|a| a == name) {
            vec![name]
        } else if let Some((_, m)) = KNOWN.iter().find(|(k, _)| *k == name) {
            if name == "all" {
                available.iter().map(String::as_str).collect()
            } else {
                m.to_vec()
            }
        } else {
            return Err(Error::invalid(format!(
                "unknown UCX transport '{name}' in '{list}' (UCX {version} here has: {})",
                names(&available)
            )));
        };
        let present: Vec<&str> = members
            .iter()
            .copied()
            .filter(|m| available.iter().any(|a| a == m))
            .collect();
        if present.is_empty() {
            missing.push(name.to_string());
        }
        if present.iter().any(|m| *m != "self") {
            reachable = true;
        }
    }
    if !negated && !reachable {
        return Err(Error::invalid(format!(
            "none of the transports in '{list}' can reach another process with UCX {version} \
             here (it has: {})",
            names(&available)
        )));
    }
    Ok(missing)
}

/// Checks a `UCX_NET_DEVICES`-style list (`mlx5_0:1`, `eth0,lo`, `all`, `^lo`) against the
/// network devices in `have`.
pub fn check_devices(list: &str, have: &[TlResource]) -> Result<()> {
    let devices: Vec<String> = have
        .iter()
        .filter(|r| r.net)
        .map(|r| r.dev.clone())
        .collect();
    let body = list.strip_prefix('^').unwrap_or(list);
    for dev in body.split(',') {
        if dev.is_empty() {
            return Err(Error::invalid(format!(
                "device list '{list}' has an empty entry"
            )));
        }
        if dev != "all" && !devices.iter().any(|d| d == dev) {
            return Err(Error::invalid(format!(
                "unknown network device '{dev}' (UCX {} here sees: {})",
                ucx_version_for_messages(),
                names(&devices)
            )));
        }
    }
    Ok(())
}

fn ucx_version_for_messages() -> String {
    static V: OnceLock<String> = OnceLock::new();
    V.get_or_init(ucx_version).clone()
}

/// How CUDA memory moves, decided from the memory types the linked UCX supports
/// (`ucp_context_query`, `UCP_ATTR_FIELD_MEMORY_TYPES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevicePath {
    /// UCX handles CUDA memory itself (a CUDA-aware UCX with a driver present): device regions
    /// can be given to UCX as they are.
    Direct,
    /// UCX has no CUDA memory support here (built without CUDA, as Debian's, or its CUDA
    /// module could not load, as the wheel's without a driver): device bytes go through pinned
    /// host buffers.
    Staged,
}

impl DevicePath {
    /// The path for a UCX that reports `memory_types` (a bit per `ucs_memory_type_t`).
    pub fn from_memory_types(memory_types: u64) -> DevicePath {
        if memory_types & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0 {
            DevicePath::Direct
        } else {
            DevicePath::Staged
        }
    }
}

/// The bit of `ucs_memory_type_t` CUDA device memory has, for tests that fake a query result.
pub const CUDA_MEMORY_BIT: u64 = 1u64 << sys::UCS_MEMORY_TYPE_CUDA;

/// Memory type bits as names: `host,cuda`.
pub fn memory_type_names(mask: u64) -> String {
    let names = [
        (sys::UCS_MEMORY_TYPE_HOST, "host"),
        (sys::UCS_MEMORY_TYPE_CUDA, "cuda"),
        (sys::UCS_MEMORY_TYPE_CUDA_MANAGED, "cuda-managed"),
        (sys::UCS_MEMORY_TYPE_ROCM, "rocm"),
        (sys::UCS_MEMORY_TYPE_ROCM_MANAGED, "rocm-managed"),
    ];
    let mut out: Vec<String> = Vec::new();
    let mut known = 0u64;
    for (bit, name) in names {
        known |= 1u64 << bit;
        if mask & (1u64 << bit) != 0 {
            out.push(name.to_string());
        }
    }
    for bit in 0..64u32 {
        if mask & !known & (1u64 << bit) != 0 {
            out.push(format!("type{bit}"));
        }
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(",")
    }
}

/// The transports and devices as one line for logs: `tcp/lo tcp/eth0 posix/memory ...`.
pub fn describe(have: &[TlResource]) -> String {
    have.iter()
        .map(|r| format!("{}/{}", r.tl, r.dev))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Reads a C string UCX returned (NULL gives "").
///
/// # Safety
/// `p` must be NULL or a NUL-terminated string that lives for the call.
#[cfg(kvlink_ucx_ep_transports)]
pub(super) unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn res(list: &[(&str, &str, bool)]) -> Vec<TlResource> {
        list.iter()
            .map(|(t, d, n)| TlResource {
                tl: t.to_string(),
                dev: d.to_string(),
                net: *n,
            })
            .collect()
    }

    fn here() -> Vec<TlResource> {
        res(&[
            ("self", "memory", false),
            ("tcp", "lo", true),
            ("tcp", "eth0", true),
            ("posix", "memory", false),
            ("sysv", "memory", false),
            ("cma", "memory", false),
        ])
    }

    #[test]
    fn transport_lists() {
        let h = here();
        assert_eq!(check_tls("tcp,self", &h).unwrap(), Vec::<String>::new());
        assert_eq!(check_tls("sm", &h).unwrap(), Vec::<String>::new());
        // Known but absent here: allowed while something else can reach a peer; reported.
        assert_eq!(
            check_tls("rc,cuda_copy,cuda_ipc,tcp", &h).unwrap(),
            vec!["rc", "cuda_copy", "cuda_ipc"]
        );
        assert!(check_tls("^cma", &h).is_ok());
        assert!(check_tls("ud:aux,tcp", &h).is_ok());
        let e = check_tls("tcp,tpc", &h).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("'tpc'"), "{}", e.message);
        assert!(
            e.message.contains("tcp"),
            "names what there is: {}",
            e.message
        );
        let e = check_tls("rc,cuda_copy,cuda_ipc", &h).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("none of"), "{}", e.message);
        assert!(
            check_tls("self", &h).is_err(),
            "self reaches no other process"
        );
        assert!(check_tls("tcp,,self", &h).is_err());
        // With an RDMA device, rc is there.
        let mut ib = h.clone();
        ib.extend(res(&[("rc_mlx5", "mlx5_0:1", true)]));
        assert!(check_tls("rc,cuda_copy,cuda_ipc", &ib).is_ok());
    }

    #[test]
    fn device_lists() {
        let h = here();
        assert!(check_devices("lo", &h).is_ok());
        assert!(check_devices("eth0,lo", &h).is_ok());
        assert!(check_devices("all", &h).is_ok());
        assert!(check_devices("^lo", &h).is_ok());
        let e = check_devices("mlx5_0:1", &h).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("'mlx5_0:1'"), "{}", e.message);
        assert!(e.message.contains("eth0, lo"), "{}", e.message);
        // "memory" is a device, but not a network device.
        assert!(check_devices("memory", &h).is_err());
        assert!(check_devices("lo,", &h).is_err());
    }

    #[test]
    fn device_path_follows_the_memory_types_ucx_reports() {
        let host = 1u64 << sys::UCS_MEMORY_TYPE_HOST;
        // A CUDA-aware UCX with a driver (faked: no GPU here) reports cuda among its types.
        assert_eq!(
            DevicePath::from_memory_types(host | CUDA_MEMORY_BIT),
            DevicePath::Direct
        );
        assert_eq!(memory_type_names(host | CUDA_MEMORY_BIT), "host,cuda");
        assert_eq!(DevicePath::from_memory_types(host), DevicePath::Staged);
        // Managed memory alone is not device memory UCX moves for us.
        let managed = 1u64 << sys::UCS_MEMORY_TYPE_CUDA_MANAGED;
        assert_eq!(
            DevicePath::from_memory_types(host | managed),
            DevicePath::Staged
        );
        assert_eq!(memory_type_names(0), "none");
    }

    #[test]
    fn the_linked_ucx_lists_tcp_on_loopback() {
        let have = resources().unwrap();
        assert!(
            have.iter().any(|r| r.tl == "tcp" && r.dev == "lo" && r.net),
            "{}",
            describe(have)
        );
        assert!(have.iter().any(|r| r.tl == "self"), "{}", describe(have));
        assert!(ucx_version().starts_with("1."));
    }
}
