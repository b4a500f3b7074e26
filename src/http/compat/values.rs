//! How many JSON values a body holds, counted before it is parsed into a
//! `serde_json::Value` (sans-IO). A 16 MiB body of `[0,0,...]` or `{},{}...`
//! is 8 million values, which a `Value` tree holds in about 700 MB: the
//! compatible routes refuse a body over [`MAX_VALUES`] after this walk,
//! which allocates nothing.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The most JSON values (each object, array, string, number, literal and
/// object key counts one) a compatible route's body may hold. A request at
/// every other cap holds far fewer: 512 messages of 16 parts each, 128 tools
/// within 256 KiB of schemas, 1,024 logit biases.
pub const MAX_VALUES: usize = 1 << 20;

/// False when `body` holds more than `cap` JSON values; true otherwise,
/// also when it is not JSON at all (the parser that follows says why).
pub fn within(body: &[u8], cap: usize) -> bool {
    let left = Cell::new(cap);
    let over = Cell::new(false);
    let mut de = serde_json::Deserializer::from_slice(body);
    let _ = Count {
        left: &left,
        over: &over,
    }
    .deserialize(&mut de);
    !over.get()
}

#[derive(Clone, Copy)]
struct Count<'a> {
    left: &'a Cell<usize>,
    over: &'a Cell<bool>,
}

impl Count<'_> {
    /// Counts one value; an error (which ends the walk) past the cap.
    fn take<E: de::Error>(self) -> Result<(), E> {
        match self.left.get().checked_sub(1) {
            Some(n) => {
                self.left.set(n);
                Ok(())
            }
            None => {
                self.over.set(true);
                Err(E::custom("too many values"))
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.take()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.take()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.take()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.take()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.take()
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.take()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.take()?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.take()?;
        while map.next_key::<IgnoredAny>()?.is_some() {
            self.take()?;
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_and_key_counts() {
        // {}, "a", [], 1, "b", {}, "c", true, null, -2.5: ten values.
        let body = br#"{"a": [1, "b", {"c": true}, null, -2.5]}"#;
        assert!(within(body, 10));
        assert!(!within(body, 9));
        assert!(within(b"0", 1));
        assert!(!within(b"[]", 0));
    }

    #[test]
    fn a_body_that_is_not_json_is_left_to_the_parser() {
        assert!(within(b"{\"a\": [1, 2", 100));
        assert!(within(b"not json", 0));
        // Past the cap before the syntax error: over.
        assert!(!within(b"[0, 0, 0, 0 oops", 2));
    }

    #[test]
    fn eight_million_values_in_16_mib_are_over_the_cap() {
        let mut body = b"{\"model\":\"m\",\"junk\":[".to_vec();
        body.extend(b"0,".repeat((16 << 20) / 2 - 20));
        body.extend(b"0]}");
        assert!(!within(&body, MAX_VALUES));
        let mut ok = b"[".to_vec();
        ok.extend(b"0,".repeat(MAX_VALUES - 2));
        ok.extend(b"0]");
        assert!(within(&ok, MAX_VALUES));
        assert!(!within(&ok, MAX_VALUES - 1));
    }
}
