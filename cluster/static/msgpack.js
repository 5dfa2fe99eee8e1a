// A small msgpack codec for the realtime video socket (maps in binary frames): nil, booleans, integers,
// floats, strings, binary (Uint8Array), arrays and maps. Extension types are refused.
"use strict";

const msgpack = (() => {
  const utf8 = new TextEncoder();
  const fromUtf8 = new TextDecoder();

  function encode(value) {
    const out = [];
    let size = 0;
    const push = (bytes) => {
      out.push(bytes);
      size += bytes.length;
    };
    const head = (n, view) => {
      const b = new Uint8Array(n);
      view(new DataView(b.buffer));
      push(b);
    };
    const length = (n, fix, fixMax, b8, b16, b32) => {
      if (fix !== null && n <= fixMax) push(Uint8Array.of(fix | n));
      else if (b8 !== null && n < 0x100) push(Uint8Array.of(b8, n));
      else if (n < 0x10000) head(3, (d) => (d.setUint8(0, b16), d.setUint16(1, n)));
      else head(5, (d) => (d.setUint8(0, b32), d.setUint32(1, n)));
    };
    const walk = (v) => {
      if (v === null || v === undefined) push(Uint8Array.of(0xc0));
      else if (v === true || v === false) push(Uint8Array.of(v ? 0xc3 : 0xc2));
      else if (typeof v === "number" && Number.isInteger(v) && Number.isSafeInteger(v)) {
        if (v >= 0 && v < 0x80) push(Uint8Array.of(v));
        else if (v < 0 && v >= -32) push(Uint8Array.of(v & 0xff));
        else if (v >= 0 && v < 0x100) push(Uint8Array.of(0xcc, v));
        else if (v >= 0 && v < 0x10000) head(3, (d) => (d.setUint8(0, 0xcd), d.setUint16(1, v)));
        else if (v >= 0 && v < 0x100000000) head(5, (d) => (d.setUint8(0, 0xce), d.setUint32(1, v)));
        else if (v >= 0) head(9, (d) => (d.setUint8(0, 0xcf), d.setBigUint64(1, BigInt(v))));
        else if (v >= -0x80) head(2, (d) => (d.setUint8(0, 0xd0), d.setInt8(1, v)));
        else if (v >= -0x8000) head(3, (d) => (d.setUint8(0, 0xd1), d.setInt16(1, v)));
        else if (v >= -0x80000000) head(5, (d) => (d.setUint8(0, 0xd2), d.setInt32(1, v)));
        else head(9, (d) => (d.setUint8(0, 0xd3), d.setBigInt64(1, BigInt(v))));
      } else if (typeof v === "number") head(9, (d) => (d.setUint8(0, 0xcb), d.setFloat64(1, v)));
      else if (typeof v === "string") {
        const bytes = utf8.encode(v);
        length(bytes.length, 0xa0, 31, 0xd9, 0xda, 0xdb);
        push(bytes);
      } else if (v instanceof Uint8Array || v instanceof ArrayBuffer) {
        const bytes = v instanceof Uint8Array ? v : new Uint8Array(v);
        length(bytes.length, null, 0, 0xc4, 0xc5, 0xc6);
        push(bytes);
      } else if (Array.isArray(v)) {
        length(v.length, 0x90, 15, null, 0xdc, 0xdd);
        v.forEach(walk);
      } else if (typeof v === "object") {
        const entries = Object.entries(v).filter(([, x]) => x !== undefined);
        length(entries.length, 0x80, 15, null, 0xde, 0xdf);
        for (const [k, x] of entries) {
          walk(k);
          walk(x);
        }
      } else throw new TypeError(`msgpack: cannot encode ${typeof v}`);
    };
    walk(value);
    const bytes = new Uint8Array(size);
    let at = 0;
    for (const part of out) {
      bytes.set(part, at);
      at += part.length;
    }
    return bytes;
  }

  function decode(input) {
    const bytes = input instanceof Uint8Array ? input : new Uint8Array(input);
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    let at = 0;
    const need = (n) => {
      if (at + n > bytes.length) throw new RangeError("msgpack: truncated message");
    };
    const take = (n) => {
      need(n);
      const part = bytes.subarray(at, at + n);
      at += n;
      return part;
    };
    const num = (n, read) => {
      need(n);
      const v = read(at);
      at += n;
      return v;
    };
    const u8 = () => num(1, (i) => view.getUint8(i));
    const u16 = () => num(2, (i) => view.getUint16(i));
    const u32 = () => num(4, (i) => view.getUint32(i));
    const str = (n) => fromUtf8.decode(take(n));
    const array = (n) => Array.from({ length: n }, () => item());
    const map = (n) => {
      const m = {};
      for (let i = 0; i < n; i++) {
        const k = item();
        m[k] = item();
      }
      return m;
    };
    const item = () => {
      const t = u8();
      if (t < 0x80) return t;
      if (t < 0x90) return map(t & 0x0f);
      if (t < 0xa0) return array(t & 0x0f);
      if (t < 0xc0) return str(t & 0x1f);
      if (t >= 0xe0) return t - 0x100;
      switch (t) {
        case 0xc0: return null;
        case 0xc2: return false;
        case 0xc3: return true;
        case 0xc4: return take(u8()).slice();
        case 0xc5: return take(u16()).slice();
        case 0xc6: return take(u32()).slice();
        case 0xca: return num(4, (i) => view.getFloat32(i));
        case 0xcb: return num(8, (i) => view.getFloat64(i));
        case 0xcc: return u8();
        case 0xcd: return u16();
        case 0xce: return u32();
        case 0xcf: return Number(num(8, (i) => view.getBigUint64(i)));
        case 0xd0: return num(1, (i) => view.getInt8(i));
        case 0xd1: return num(2, (i) => view.getInt16(i));
        case 0xd2: return num(4, (i) => view.getInt32(i));
        case 0xd3: return Number(num(8, (i) => view.getBigInt64(i)));
        case 0xd9: return str(u8());
        case 0xda: return str(u16());
        case 0xdb: return str(u32());
        case 0xdc: return array(u16());
        case 0xdd: return array(u32());
        case 0xde: return map(u16());
        case 0xdf: return map(u32());
        default: throw new TypeError(`msgpack: unsupported type byte 0x${t.toString(16)}`);
      }
    };
    const value = item();
    if (at !== bytes.length) throw new RangeError("msgpack: bytes left after the message");
    return value;
  }

  return { encode, decode };
})();
