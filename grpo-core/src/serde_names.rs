//! Serde for the option enums by their TRL spellings (`"dr_grpo"`, `"sequence_mask"`, ...):
//! serialized with `as_str`, read with `FromStr`, whose error lists the accepted names.

/// `serde_by_name!(Type, "expected")` implements `Serialize` (the `as_str` name) and
/// `Deserialize` (a string through `FromStr`; with a trailing `bool`, also a boolean through
/// `FromStr` of `"true"` / `"false"`).
#[macro_export]
#[doc(hidden)]
macro_rules! serde_by_name {
    ($t:ty, $expected:literal $(, $bool:ident)?) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> ::core::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> ::core::result::Result<Self, D::Error> {
                struct V;
                impl serde::de::Visitor<'_> for V {
                    type Value = $t;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str($expected)
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> ::core::result::Result<$t, E> {
                        v.parse().map_err(E::custom)
                    }
                    $(
                        fn visit_bool<E: serde::de::Error>(self, v: bool) -> ::core::result::Result<$t, E> {
                            let _ = stringify!($bool);
                            v.to_string().parse().map_err(E::custom)
                        }
                    )?
                }
                d.deserialize_any(V)
            }
        }
    };
}
