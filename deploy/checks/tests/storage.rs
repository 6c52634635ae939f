//! NATS storage of every overlay: each JetStream store asyncrl creates has
//! a byte limit (`[bus.storage]`), and the limits together fit in the
//! server's `max_file_store`, which fits in its volume. So a store reaches
//! its own limit (and `AsyncrlNatsStoreNearLimit` fires) before the server
//! runs out of disk, and no store can starve the others.

use std::path::Path;

use asyncrl_config::Config;
use asyncrl_deploy_checks::{Rendered, nats_conf_value, overlays, quantity_bytes};

/// The stores of a run: the trajectory and dead-letter streams, the
/// control KV bucket, and two object stores (WEIGHTS and the buffer's
/// large batches).
const KV_BUCKETS: u64 = 1;
const OBJECT_STORES: u64 = 2;

#[test]
fn every_store_is_bounded_and_the_bounds_fit_the_nats_volume() {
    let all: Vec<Rendered> = overlays().iter().map(|o| Rendered::of(o)).collect();
    assert!(!all.is_empty(), "no overlays");
    for r in all {
        let ctx = &r.name;
        let text = r.config_map_data("asyncrl-config", "asyncrl.toml");
        let cfg = Config::parse(&text, Some(Path::new("asyncrl.toml")))
            .unwrap_or_else(|e| panic!("overlay {ctx}: asyncrl.toml: {e}"));
        let s = &cfg.bus.storage;
        assert!(
            s.object_store_max_bytes > 0,
            "overlay {ctx}: bus.storage.object_store_max_bytes is 0 (bounded by count only); a deployment sets a byte bound"
        );
        let sum = s.trajectories_max_bytes
            + s.dead_letters_max_bytes
            + KV_BUCKETS * s.kv_max_bytes
            + OBJECT_STORES * s.object_store_max_bytes;
        let conf = r.config_map_data("nats-config", "nats.conf");
        let store = quantity_bytes(
            &nats_conf_value(&conf, "max_file_store")
                .unwrap_or_else(|| panic!("overlay {ctx}: nats.conf sets no max_file_store")),
        );
        assert!(
            sum < store,
            "overlay {ctx}: the bus.storage limits sum to {sum} bytes, more than NATS max_file_store {store}"
        );
        let sts = r.get("StatefulSet", "nats");
        let disk = quantity_bytes(
            sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
                .as_str()
                .expect("the NATS volume's size"),
        );
        assert!(
            store < disk,
            "overlay {ctx}: max_file_store {store} exceeds the volume {disk}"
        );
        eprintln!(
            "overlay {ctx}: store limits {:.2} GiB < max_file_store {:.2} GiB < volume {:.2} GiB",
            sum as f64 / f64::from(1u32 << 30),
            store as f64 / f64::from(1u32 << 30),
            disk as f64 / f64::from(1u32 << 30)
        );
    }
}
