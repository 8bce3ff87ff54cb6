//! Crate-wide macros.

/// Declares a settings section once: the struct (serde default + deny_unknown_fields), its
/// `Default` from the `= value` after each field, and `DOCS` (field name, doc text) for
/// `ragen-lab settings`. One declaration serves all three, so they cannot drift. Used by the
/// trainer's sections (`starpo::settings`) and the Echo-Trap thresholds (`metrics::echo_trap`).
macro_rules! settings_section {
    ($(#[doc = $sdoc:literal])* $name:ident { $( $(#[doc = $doc:literal])+ $field:ident : $ty:ty = $default:expr, )* }) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name { $( $(#[doc = $doc])+ pub $field: $ty, )* }
        impl Default for $name {
            fn default() -> Self { Self { $($field: $default,)* } }
        }
        impl $name {
            /// (field, doc) for every field, in declaration order.
            pub const DOCS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($field), concat!($($doc, "\n"),+)),)*];
        }
    };
}
