//! Settings read from the environment (`KVLINK_*`): a value is used as documented, and one that
//! is not a value of the setting is an `InvalidArgument` naming it, never silently replaced by
//! the default. Each test changes the process's environment: one at a time (`ENV`).
use kvlink::connection::{Engine, EngineConfig};
use kvlink::transport::TransportKind;
use kvlink::ErrorKind;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ENV: Mutex<()> = Mutex::new(());

fn listening(name: &str, rank: u32, secret: Option<Vec<u8>>) -> Engine {
    let mut c = EngineConfig::new(name, rank, TransportKind::Tcp);
    c.listen = Some("127.0.0.1:0".parse().unwrap());
    c.secret = secret;
    Engine::new(c).unwrap()
}

#[test]
fn a_secret_from_the_environment_that_is_not_utf8_is_still_the_secret() {
    let _one = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let secret = b"\xffdeployment-\xfesecret".to_vec();
    std::env::set_var("KVLINK_SECRET", OsStr::from_bytes(&secret));
    let ctx = listening("ctx", 0, None);
    let d = || Instant::now() + Duration::from_secs(5);
    // A rank without any secret must be refused by one that holds the environment's.
    let stranger = listening("stranger", 1, Some(Vec::new()));
    let e = stranger
        .connect(&ctx.address(), d())
        .expect_err("a rank without the secret was let in");
    assert_eq!(e.kind, ErrorKind::AuthFailed, "{e}");
    // One that holds the same bytes is let in.
    let friend = listening("friend", 2, Some(secret));
    friend.connect(&ctx.address(), d()).unwrap();
    std::env::remove_var("KVLINK_SECRET");
}

#[test]
fn a_tuning_variable_that_is_not_a_value_is_invalid_argument_naming_it() {
    let _one = ENV.lock().unwrap_or_else(|e| e.into_inner());
    for (var, bad) in [
        ("KVLINK_POLL_US", "100us"),
        ("KVLINK_POLL_US", "-1"),
        ("KVLINK_DRIVE_SPIN_US", "lots"),
        ("KVLINK_STUCK", "reprot"),
    ] {
        std::env::set_var(var, bad);
        let r = Engine::new(EngineConfig::new("knob", 0, TransportKind::Tcp));
        std::env::remove_var(var);
        let e = r
            .err()
            .unwrap_or_else(|| panic!("{var}={bad} was taken without a word"));
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{var}={bad}: {e}");
        assert!(e.message.contains(var), "{var}={bad}: {}", e.message);
    }
    // Good values still start an engine.
    for (var, good) in [
        ("KVLINK_POLL_US", "0"),
        ("KVLINK_POLL_US", " 20 "),
        ("KVLINK_DRIVE_SPIN_US", "0"),
        ("KVLINK_STUCK", "report"),
    ] {
        std::env::set_var(var, good);
        let r = Engine::new(EngineConfig::new("knob", 0, TransportKind::Tcp));
        std::env::remove_var(var);
        r.unwrap_or_else(|e| panic!("{var}={good:?}: {e}"));
    }
}
