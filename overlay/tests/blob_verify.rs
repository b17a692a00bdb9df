//! A large uncompressed blob (a page pack) is verified mapped, on every core: intact it
//! passes with its length, and one flipped byte anywhere in it, or a cut, fails it with
//! [`BlobError::Corrupt`].

use std::fs;

use belayer_overlay::layer::{BlobBatch, BlobError, BlobStore, PARALLEL_HASH_MIN};

fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn a_large_pack_is_verified_whole_and_damage_anywhere_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(&dir.path().join("store")).unwrap();
    let len = (PARALLEL_HASH_MIN as usize) * 2 + 12_345;
    let data = noise(len, 3);
    let mut pack = store.pack_writer().unwrap();
    pack.append(&data).unwrap();
    let mut batch = BlobBatch::default();
    let (id, _) = pack.finish(&mut batch).unwrap();
    store.commit(batch).unwrap();
    assert_eq!(store.verify(&id).unwrap(), len as u64);
    let path = store.blob_path(&id);
    for at in [0, len / 2, len - 1] {
        let mut bytes = data.clone();
        bytes[at] ^= 0x01;
        fs::write(&path, &bytes).unwrap();
        assert!(
            matches!(store.verify(&id), Err(BlobError::Corrupt { blob, .. }) if blob == id),
            "a flipped byte at {at}"
        );
    }
    fs::write(&path, &data[..len - 1]).unwrap();
    assert!(matches!(store.verify(&id), Err(BlobError::Corrupt { .. })));
    fs::write(&path, &data).unwrap();
    assert_eq!(store.verify(&id).unwrap(), len as u64);
}
