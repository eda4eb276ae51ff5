//! The id → position index behind [`Messages`](crate::Messages).
//!
//! A hash table of `(hash of id, position)` slots. The ids themselves live only in the
//! message list: the table holds no copy of them, so appending allocates nothing but
//! the slot, a slot is 16 bytes, and rehashing never reads the ids (it reuses the stored
//! hash). A lookup compares the stored hash first and reads the id from the list only
//! for a slot whose hash matches.

use std::hash::{BuildHasher, RandomState};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use keel_message::Message;

#[derive(Debug, Clone, Copy)]
struct Slot {
    hash: u64,
    pos: usize,
}

/// Id → position for a list of messages that all have distinct ids.
#[derive(Debug, Clone, Default)]
pub(crate) struct IdIndex {
    table: HashTable<Slot>,
    hasher: RandomState,
}

fn id_at(list: &[Message], pos: usize) -> Option<&str> {
    list.get(pos).and_then(|m| m.id.as_deref())
}

impl IdIndex {
    pub(crate) fn with_capacity(n: usize) -> Self {
        IdIndex {
            table: HashTable::with_capacity(n),
            hasher: RandomState::new(),
        }
    }

    fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The position of `id` in `list`.
    pub(crate) fn position(&self, list: &[Message], id: &str) -> Option<usize> {
        let hash = self.hash(id);
        self.table
            .find(hash, |s| s.hash == hash && id_at(list, s.pos) == Some(id))
            .map(|s| s.pos)
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
        match self.table.entry(
            hash,
            |s| s.hash == hash && id_at(list, s.pos) == Some(id),
            |s| s.hash,
        ) {
            Entry::Occupied(e) => Some(e.get().pos),
            Entry::Vacant(e) => {
                e.insert(Slot { hash, pos: new_pos });
                None
            }
        }
    }

    /// Forgets the message `id`, which is at `pos`.
    pub(crate) fn remove(&mut self, id: &str, pos: usize) {
        let hash = self.hash(id);
        if let Ok(e) = self.table.find_entry(hash, |s| s.pos == pos) {
            e.remove();
        }
    }

    pub(crate) fn clear(&mut self) {
        self.table.clear();
    }

    /// After the list was filtered: `remap[old position]` is the new position, or
    /// `None` for a message that was removed.
    pub(crate) fn remap(&mut self, remap: &[Option<usize>]) {
        self.table
            .retain(|s| match remap.get(s.pos).copied().flatten() {
                Some(p) => {
                    s.pos = p;
                    true
                }
                None => false,
            });
    }
}
