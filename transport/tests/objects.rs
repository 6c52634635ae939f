//! The NATS object store's checks with a real nats-server: a get is checked
//! against the sha256 of the bytes as they arrive (not only against what the
//! object's metadata says), objects written by the plain client are read
//! and checked the same way.

use asyncrl_config::BusConfig;
use asyncrl_testkit::NatsServer;
use asyncrl_transport::{Bus, NatsBus, TransportError, TransportMetrics, sha256_hex};
use bytes::Bytes;

/// The client's default chunk size.
const CHUNK: usize = 128 * 1024;

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

async fn setup() -> (NatsServer, NatsBus, async_nats::jetstream::Context) {
    let server = NatsServer::start().expect("start nats-server");
    let bus = NatsBus::connect(&BusConfig::nats(server.url()), TransportMetrics::new())
        .await
        .expect("connect");
    let client = async_nats::connect(server.url())
        .await
        .expect("raw connect");
    (server, bus, async_nats::jetstream::new(client))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_changed_on_the_server_fails_the_checksum_of_every_get() {
    let (_server, bus, js) = setup().await;
    let store = bus.object_store("BLOBS").await.unwrap();
    let original = data(3 * CHUNK + 1000);
    let sha = sha256_hex(&original);
    let info = store.put("w", Bytes::from(original.clone())).await.unwrap();
    assert_eq!(info.sha256, sha);
    assert_eq!(store.get_expecting("w", &sha).await.unwrap(), original);

    // Rewrite the chunks with one byte flipped: same size, same chunking,
    // same metadata (digest included), other bytes.
    let raw = js.get_object_store("BLOBS").await.unwrap();
    let nuid = raw.info("w").await.unwrap().nuid;
    let subject = format!("$O.BLOBS.C.{nuid}");
    js.get_stream("OBJ_BLOBS")
        .await
        .unwrap()
        .purge()
        .filter(subject.as_str())
        .await
        .unwrap();
    let mut changed = original.clone();
    changed[CHUNK + 7] ^= 0x01;
    for chunk in changed.chunks(CHUNK) {
        js.publish(subject.clone(), Bytes::copy_from_slice(chunk))
            .await
            .unwrap()
            .await
            .unwrap();
    }
    assert_eq!(store.info("w").await.unwrap().unwrap().sha256, sha);

    for result in [store.get("w").await, store.get_expecting("w", &sha).await] {
        let err = result.unwrap_err();
        assert!(
            matches!(err, TransportError::ChecksumMismatch { .. }),
            "{err:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_put_by_the_plain_client_is_read_and_checked() {
    let (_server, bus, js) = setup().await;
    let store = bus.object_store("BLOBS").await.unwrap();
    let original = data(2 * CHUNK + 5);
    let sha = sha256_hex(&original);
    let raw = js.get_object_store("BLOBS").await.unwrap();
    raw.put("plain", &mut original.as_slice()).await.unwrap();

    let info = store.info("plain").await.unwrap().unwrap();
    assert_eq!(
        (info.size, info.sha256.as_str()),
        (original.len() as u64, sha.as_str())
    );
    assert_eq!(store.get_expecting("plain", &sha).await.unwrap(), original);
    assert_eq!(
        store
            .get_expecting("plain", &sha.to_uppercase())
            .await
            .unwrap(),
        original
    );
    let err = store
        .get_expecting("plain", &sha256_hex(b"other"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, TransportError::ChecksumMismatch { actual, .. } if *actual == sha),
        "{err:?}"
    );
    // An empty object has the sha256 of no bytes.
    store.put("empty", Bytes::new()).await.unwrap();
    assert_eq!(
        store
            .get_expecting("empty", &sha256_hex(b""))
            .await
            .unwrap(),
        Bytes::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_we_put_is_read_by_the_plain_client_and_a_replaced_one_leaves_no_chunks() {
    let (_server, bus, js) = setup().await;
    let store = bus.object_store("BLOBS").await.unwrap();
    let first = data(5 * CHUNK + 3);
    store.put("w", Bytes::from(first.clone())).await.unwrap();
    let raw = js.get_object_store("BLOBS").await.unwrap();
    let mut back = Vec::new();
    {
        use tokio::io::AsyncReadExt as _;
        // The client checks the bytes against the digest we wrote.
        let mut object = raw.get("w").await.unwrap();
        object.read_to_end(&mut back).await.unwrap();
    }
    assert_eq!(back, first);
    assert_eq!(raw.info("w").await.unwrap().chunks, 6);

    // Replaced: the new bytes, and only its chunks (plus one metadata
    // message) stay in the bucket's stream.
    let second: Vec<u8> = data(2 * CHUNK).into_iter().rev().collect();
    let info = store.put("w", Bytes::from(second.clone())).await.unwrap();
    assert_eq!(info.sha256, sha256_hex(&second));
    assert_eq!(store.get("w").await.unwrap(), second);
    let mut stream = js.get_stream("OBJ_BLOBS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 2 + 1);
}
