//! The id → position index behind [`Messages`](crate::Messages).
//!
//! A hash table of `(hash of id, position)` slots. The ids themselves live only in the
//! message list: the table holds no copy of them, so appending allocates nothing but
//! the slot, a slot is 16 bytes, and rehashing never reads the ids (it reuses the stored
//! hash). A lookup compares the stored hash first and reads the id from the list only
//! for a slot whose hash matches.

use std::hash::{BuildHasher, RandomState};

use hashbrown::HashTable;
use keel_message::Message;

#[derive(Debug, Clone, Copy)]
struct Slot {
    hash: u64,
    pos: usize,
}

/// Slots waiting to go into the table, inserted together.
const BATCH: usize = 32;

/// Id → position for a list of messages that all have distinct ids.
///
/// New ids wait in a short `pending` list and enter the table [`BATCH`] at a time. In a
/// long history the table is larger than the CPU's caches, and each insert touches a
/// random slot of it; inserting a batch at once lets those memory accesses overlap, so
/// appending to a 100,000-message history costs close to appending to a short one.
#[derive(Debug, Clone, Default)]
pub(crate) struct IdIndex {
    table: HashTable<Slot>,
    pending: Vec<Slot>,
    hasher: RandomState,
}

fn id_at(list: &[Message], pos: usize) -> Option<&str> {
    list.get(pos).and_then(|m| m.id.as_deref())
}

impl IdIndex {
    pub(crate) fn with_capacity(n: usize) -> Self {
        IdIndex {
            table: HashTable::with_capacity(n),
            pending: Vec::with_capacity(BATCH),
            hasher: RandomState::new(),
        }
    }

    fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.len() + self.pending.len()
    }

    fn pending_position(&self, list: &[Message], hash: u64, id: &str) -> Option<usize> {
        self.pending
            .iter()
            .find(|s| s.hash == hash && id_at(list, s.pos) == Some(id))
            .map(|s| s.pos)
    }

    fn flush(&mut self) {
        for slot in self.pending.drain(..) {
            self.table.insert_unique(slot.hash, slot, |s| s.hash);
        }
    }

    /// The position of `id` in `list`.
    pub(crate) fn position(&self, list: &[Message], id: &str) -> Option<usize> {
        let hash = self.hash(id);
        self.table
            .find(hash, |s| s.hash == hash && id_at(list, s.pos) == Some(id))
            .map(|s| s.pos)
            .or_else(|| self.pending_position(list, hash, id))
    }

    /// The position of `id` if `list` holds it; otherwise records it at `new_pos` and
    /// returns `None`.
    pub(crate) fn get_or_insert(
        &mut self,
        list: &[Message],
        id: &str,
        new_pos: usize,
    ) -> Option<usize> {
        let hash = self.hash(id);
        if let Some(pos) = self.pending_position(list, hash, id) {
            return Some(pos);
        }
        if let Some(s) = self
            .table
            .find(hash, |s| s.hash == hash && id_at(list, s.pos) == Some(id))
        {
            return Some(s.pos);
        }
        self.pending.push(Slot { hash, pos: new_pos });
        if self.pending.len() >= BATCH {
            self.flush();
        }
        None
    }

    /// Forgets the message `id`, which is at `pos`.
    pub(crate) fn remove(&mut self, id: &str, pos: usize) {
        let hash = self.hash(id);
        if let Some(i) = self
            .pending
            .iter()
            .position(|s| s.pos == pos && s.hash == hash)
        {
            self.pending.swap_remove(i);
        } else if let Ok(e) = self.table.find_entry(hash, |s| s.pos == pos) {
            e.remove();
        }
    }

    pub(crate) fn clear(&mut self) {
        self.table.clear();
        self.pending.clear();
    }

    /// After the list was filtered: `remap[old position]` is the new position, or
    /// `None` for a message that was removed.
    pub(crate) fn remap(&mut self, remap: &[Option<usize>]) {
        let apply = |s: &mut Slot| match remap.get(s.pos).copied().flatten() {
            Some(p) => {
                s.pos = p;
                true
            }
            None => false,
        };
        self.table.retain(apply);
        self.pending.retain_mut(apply);
    }
}
