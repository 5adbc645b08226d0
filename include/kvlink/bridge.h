// GENERATED from src/bridge.rs by scripts/gen-header.sh (cxx's code generator).
// Do not edit: change src/bridge.rs and rerun the script. CI fails when this file drifts.
// Include <kvlink/kvlink.hpp> instead: it adds typed errors on top of these declarations.
#pragma once
#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#if __cplusplus >= 201703L
#include <string_view>
#endif
#if __cplusplus >= 202002L
#include <ranges>
#endif

#ifdef __clang__
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdollar-in-identifier-extension"
#endif // __clang__

namespace rust {
inline namespace cxxbridge1 {
// #include "rust/cxx.h"

#ifndef CXXBRIDGE1_PANIC
#define CXXBRIDGE1_PANIC
template <typename Exception>
void panic [[noreturn]] (const char *msg);
#endif // CXXBRIDGE1_PANIC

struct unsafe_bitcopy_t;

namespace {
template <typename T>
class impl;
} // namespace

template <typename T>
::std::size_t size_of();
template <typename T>
::std::size_t align_of();

#ifndef CXXBRIDGE1_RUST_STRING
#define CXXBRIDGE1_RUST_STRING
class String final {
public:
  String() noexcept;
  String(const String &) noexcept;
  String(String &&) noexcept;
  ~String() noexcept;

  String(const std::string &);
  String(const char *);
  String(const char *, std::size_t);
  String(const char16_t *);
  String(const char16_t *, std::size_t);
#ifdef __cpp_char8_t
  String(const char8_t *s);
  String(const char8_t *s, std::size_t len);
#endif

  static String lossy(const std::string &) noexcept;
  static String lossy(const char *) noexcept;
  static String lossy(const char *, std::size_t) noexcept;
  static String lossy(const char16_t *) noexcept;
  static String lossy(const char16_t *, std::size_t) noexcept;

  String &operator=(const String &) & noexcept;
  String &operator=(String &&) & noexcept;

  explicit operator std::string() const;

  const char *data() const noexcept;
  char *data() noexcept;

  std::size_t size() const noexcept;
  std::size_t length() const noexcept;
  bool empty() const noexcept;

  const char *c_str() noexcept;

  std::size_t capacity() const noexcept;
  void reserve(size_t new_cap) noexcept;

  using iterator = char *;
  iterator begin() noexcept;
  iterator end() noexcept;

  using const_iterator = const char *;
  const_iterator begin() const noexcept;
  const_iterator end() const noexcept;
  const_iterator cbegin() const noexcept;
  const_iterator cend() const noexcept;

  bool operator==(const String &) const noexcept;
  bool operator!=(const String &) const noexcept;
  bool operator<(const String &) const noexcept;
  bool operator<=(const String &) const noexcept;
  bool operator>(const String &) const noexcept;
  bool operator>=(const String &) const noexcept;

  void swap(String &) noexcept;

  String(unsafe_bitcopy_t, const String &) noexcept;

private:
  struct lossy_t;
  String(lossy_t, const char *, std::size_t) noexcept;
  String(lossy_t, const char16_t *, std::size_t) noexcept;
  friend void swap(String &lhs, String &rhs) noexcept { lhs.swap(rhs); }

  std::array<std::uintptr_t, 3> repr;
};
#endif // CXXBRIDGE1_RUST_STRING

#ifndef CXXBRIDGE1_RUST_STR
#define CXXBRIDGE1_RUST_STR
class Str final {
public:
  Str() noexcept;
  Str(const String &) noexcept;
  Str(const std::string &);
  Str(const char *);
  Str(const char *, std::size_t);

  Str &operator=(const Str &) & noexcept = default;

  explicit operator std::string() const;
#if __cplusplus >= 201703L
  explicit operator std::string_view() const;
#endif

  const char *data() const noexcept;
  std::size_t size() const noexcept;
  std::size_t length() const noexcept;
  bool empty() const noexcept;

  Str(const Str &) noexcept = default;
  ~Str() noexcept = default;

  using iterator = const char *;
  using const_iterator = const char *;
  const_iterator begin() const noexcept;
  const_iterator end() const noexcept;
  const_iterator cbegin() const noexcept;
  const_iterator cend() const noexcept;

  bool operator==(const Str &) const noexcept;
  bool operator!=(const Str &) const noexcept;
  bool operator<(const Str &) const noexcept;
  bool operator<=(const Str &) const noexcept;
  bool operator>(const Str &) const noexcept;
  bool operator>=(const Str &) const noexcept;

  void swap(Str &) noexcept;

private:
  class uninit;
  Str(uninit) noexcept;
  friend impl<Str>;

  std::array<std::uintptr_t, 2> repr;
};
#endif // CXXBRIDGE1_RUST_STR

#ifndef CXXBRIDGE1_RUST_SLICE
#define CXXBRIDGE1_RUST_SLICE
namespace detail {
template <bool>
struct copy_assignable_if {};

template <>
struct copy_assignable_if<false> {
  copy_assignable_if() noexcept = default;
  copy_assignable_if(const copy_assignable_if &) noexcept = default;
  copy_assignable_if &operator=(const copy_assignable_if &) & noexcept = delete;
  copy_assignable_if &operator=(copy_assignable_if &&) & noexcept = default;
};
} // namespace detail

template <typename T>
class Slice final
    : private detail::copy_assignable_if<std::is_const<T>::value> {
public:
  using value_type = T;

  Slice() noexcept;
  Slice(T *, std::size_t count) noexcept;

  template <typename C>
  explicit Slice(C &c) : Slice(c.data(), c.size()) {}

  Slice &operator=(const Slice<T> &) & noexcept = default;
  Slice &operator=(Slice<T> &&) & noexcept = default;

  T *data() const noexcept;
  std::size_t size() const noexcept;
  std::size_t length() const noexcept;
  bool empty() const noexcept;

  T &operator[](std::size_t n) const noexcept;
  T &at(std::size_t n) const;
  T &front() const noexcept;
  T &back() const noexcept;

  Slice(const Slice<T> &) noexcept = default;
  ~Slice() noexcept = default;

  class iterator;
  iterator begin() const noexcept;
  iterator end() const noexcept;

  void swap(Slice &) noexcept;

private:
  class uninit;
  Slice(uninit) noexcept;
  friend impl<Slice>;
  friend void sliceInit(void *, const void *, std::size_t) noexcept;
  friend void *slicePtr(const void *) noexcept;
  friend std::size_t sliceLen(const void *) noexcept;

  std::array<std::uintptr_t, 2> repr;
};

#ifdef __cpp_deduction_guides
template <typename C>
explicit Slice(C &c)
    -> Slice<std::remove_reference_t<decltype(*std::declval<C>().data())>>;
#endif // __cpp_deduction_guides

template <typename T>
class Slice<T>::iterator final {
public:
#if __cplusplus >= 202002L
  using iterator_category = std::contiguous_iterator_tag;
#else
  using iterator_category = std::random_access_iterator_tag;
#endif
  using value_type = T;
  using difference_type = std::ptrdiff_t;
  using pointer = typename std::add_pointer<T>::type;
  using reference = typename std::add_lvalue_reference<T>::type;

  reference operator*() const noexcept;
  pointer operator->() const noexcept;
  reference operator[](difference_type) const noexcept;

  iterator &operator++() noexcept;
  iterator operator++(int) noexcept;
  iterator &operator--() noexcept;
  iterator operator--(int) noexcept;

  iterator &operator+=(difference_type) noexcept;
  iterator &operator-=(difference_type) noexcept;
  iterator operator+(difference_type) const noexcept;
  friend inline iterator operator+(difference_type lhs, iterator rhs) noexcept {
    return rhs + lhs;
  }
  iterator operator-(difference_type) const noexcept;
  difference_type operator-(const iterator &) const noexcept;

  bool operator==(const iterator &) const noexcept;
  bool operator!=(const iterator &) const noexcept;
  bool operator<(const iterator &) const noexcept;
  bool operator<=(const iterator &) const noexcept;
  bool operator>(const iterator &) const noexcept;
  bool operator>=(const iterator &) const noexcept;

private:
  friend class Slice;
  void *pos;
  std::size_t stride;
};

template <typename T>
Slice<T>::Slice() noexcept {
  sliceInit(this, reinterpret_cast<void *>(align_of<T>()), 0);
}

template <typename T>
Slice<T>::Slice(T *s, std::size_t count) noexcept {
  assert(s != nullptr || count == 0);
  sliceInit(this,
            s == nullptr && count == 0
                ? reinterpret_cast<void *>(align_of<T>())
                : const_cast<typename std::remove_const<T>::type *>(s),
            count);
}

template <typename T>
T *Slice<T>::data() const noexcept {
  return reinterpret_cast<T *>(slicePtr(this));
}

template <typename T>
std::size_t Slice<T>::size() const noexcept {
  return sliceLen(this);
}

template <typename T>
std::size_t Slice<T>::length() const noexcept {
  return this->size();
}

template <typename T>
bool Slice<T>::empty() const noexcept {
  return this->size() == 0;
}

template <typename T>
T &Slice<T>::operator[](std::size_t n) const noexcept {
  assert(n < this->size());
  auto ptr = static_cast<char *>(slicePtr(this)) + size_of<T>() * n;
  return *reinterpret_cast<T *>(ptr);
}

template <typename T>
T &Slice<T>::at(std::size_t n) const {
  if (n >= this->size()) {
    panic<std::out_of_range>("rust::Slice index out of range");
  }
  return (*this)[n];
}

template <typename T>
T &Slice<T>::front() const noexcept {
  assert(!this->empty());
  return (*this)[0];
}

template <typename T>
T &Slice<T>::back() const noexcept {
  assert(!this->empty());
  return (*this)[this->size() - 1];
}

template <typename T>
typename Slice<T>::iterator::reference
Slice<T>::iterator::operator*() const noexcept {
  return *static_cast<T *>(this->pos);
}

template <typename T>
typename Slice<T>::iterator::pointer
Slice<T>::iterator::operator->() const noexcept {
  return static_cast<T *>(this->pos);
}

template <typename T>
typename Slice<T>::iterator::reference Slice<T>::iterator::operator[](
    typename Slice<T>::iterator::difference_type n) const noexcept {
  auto ptr = static_cast<char *>(this->pos) + this->stride * n;
  return *reinterpret_cast<T *>(ptr);
}

template <typename T>
typename Slice<T>::iterator &Slice<T>::iterator::operator++() noexcept {
  this->pos = static_cast<char *>(this->pos) + this->stride;
  return *this;
}

template <typename T>
typename Slice<T>::iterator Slice<T>::iterator::operator++(int) noexcept {
  auto ret = iterator(*this);
  this->pos = static_cast<char *>(this->pos) + this->stride;
  return ret;
}

template <typename T>
typename Slice<T>::iterator &Slice<T>::iterator::operator--() noexcept {
  this->pos = static_cast<char *>(this->pos) - this->stride;
  return *this;
}

template <typename T>
typename Slice<T>::iterator Slice<T>::iterator::operator--(int) noexcept {
  auto ret = iterator(*this);
  this->pos = static_cast<char *>(this->pos) - this->stride;
  return ret;
}

template <typename T>
typename Slice<T>::iterator &Slice<T>::iterator::operator+=(
    typename Slice<T>::iterator::difference_type n) noexcept {
  this->pos = static_cast<char *>(this->pos) + this->stride * n;
  return *this;
}

template <typename T>
typename Slice<T>::iterator &Slice<T>::iterator::operator-=(
    typename Slice<T>::iterator::difference_type n) noexcept {
  this->pos = static_cast<char *>(this->pos) - this->stride * n;
  return *this;
}

template <typename T>
typename Slice<T>::iterator Slice<T>::iterator::operator+(
    typename Slice<T>::iterator::difference_type n) const noexcept {
  auto ret = iterator(*this);
  ret.pos = static_cast<char *>(this->pos) + this->stride * n;
  return ret;
}

template <typename T>
typename Slice<T>::iterator Slice<T>::iterator::operator-(
    typename Slice<T>::iterator::difference_type n) const noexcept {
  auto ret = iterator(*this);
  ret.pos = static_cast<char *>(this->pos) - this->stride * n;
  return ret;
}

template <typename T>
typename Slice<T>::iterator::difference_type
Slice<T>::iterator::operator-(const iterator &other) const noexcept {
  auto diff = std::distance(static_cast<char *>(other.pos),
                            static_cast<char *>(this->pos));
  return diff / static_cast<typename Slice<T>::iterator::difference_type>(
                    this->stride);
}

template <typename T>
bool Slice<T>::iterator::operator==(const iterator &other) const noexcept {
  return this->pos == other.pos;
}

template <typename T>
bool Slice<T>::iterator::operator!=(const iterator &other) const noexcept {
  return this->pos != other.pos;
}

template <typename T>
bool Slice<T>::iterator::operator<(const iterator &other) const noexcept {
  return this->pos < other.pos;
}

template <typename T>
bool Slice<T>::iterator::operator<=(const iterator &other) const noexcept {
  return this->pos <= other.pos;
}

template <typename T>
bool Slice<T>::iterator::operator>(const iterator &other) const noexcept {
  return this->pos > other.pos;
}

template <typename T>
bool Slice<T>::iterator::operator>=(const iterator &other) const noexcept {
  return this->pos >= other.pos;
}

template <typename T>
typename Slice<T>::iterator Slice<T>::begin() const noexcept {
  iterator it;
  it.pos = slicePtr(this);
  it.stride = size_of<T>();
  return it;
}

template <typename T>
typename Slice<T>::iterator Slice<T>::end() const noexcept {
  iterator it = this->begin();
  it.pos = static_cast<char *>(it.pos) + it.stride * this->size();
  return it;
}

template <typename T>
void Slice<T>::swap(Slice &rhs) noexcept {
  std::swap(*this, rhs);
}
#endif // CXXBRIDGE1_RUST_SLICE

#ifndef CXXBRIDGE1_RUST_BOX
#define CXXBRIDGE1_RUST_BOX
template <typename T>
class Box final {
public:
  using element_type = T;
  using const_pointer =
      typename std::add_pointer<typename std::add_const<T>::type>::type;
  using pointer = typename std::add_pointer<T>::type;

  Box() = delete;
  Box(Box &&) noexcept;
  ~Box() noexcept;

  explicit Box(const T &);
  explicit Box(T &&);

  Box &operator=(Box &&) & noexcept;

  const T *operator->() const noexcept;
  const T &operator*() const noexcept;
  T *operator->() noexcept;
  T &operator*() noexcept;

  template <typename... Fields>
  static Box in_place(Fields &&...);

  void swap(Box &) noexcept;

  static Box from_raw(T *) noexcept;

  T *into_raw() noexcept;

  /* Deprecated */ using value_type = element_type;

private:
  class uninit;
  class allocation;
  Box(uninit) noexcept;
  void drop() noexcept;

  friend void swap(Box &lhs, Box &rhs) noexcept { lhs.swap(rhs); }

  T *ptr;
};

template <typename T>
class Box<T>::uninit {};

template <typename T>
class Box<T>::allocation {
  static T *alloc() noexcept;
  static void dealloc(T *) noexcept;

public:
  allocation() noexcept : ptr(alloc()) {}
  ~allocation() noexcept {
    if (this->ptr) {
      dealloc(this->ptr);
    }
  }
  T *ptr;
};

template <typename T>
Box<T>::Box(Box &&other) noexcept : ptr(other.ptr) {
  other.ptr = nullptr;
}

template <typename T>
Box<T>::Box(const T &val) {
  allocation alloc;
  ::new (alloc.ptr) T(val);
  this->ptr = alloc.ptr;
  alloc.ptr = nullptr;
}

template <typename T>
Box<T>::Box(T &&val) {
  allocation alloc;
  ::new (alloc.ptr) T(std::move(val));
  this->ptr = alloc.ptr;
  alloc.ptr = nullptr;
}

template <typename T>
Box<T>::~Box() noexcept {
  if (this->ptr) {
    this->drop();
  }
}

template <typename T>
Box<T> &Box<T>::operator=(Box &&other) & noexcept {
  if (this->ptr) {
    this->drop();
  }
  this->ptr = other.ptr;
  other.ptr = nullptr;
  return *this;
}

template <typename T>
const T *Box<T>::operator->() const noexcept {
  return this->ptr;
}

template <typename T>
const T &Box<T>::operator*() const noexcept {
  return *this->ptr;
}

template <typename T>
T *Box<T>::operator->() noexcept {
  return this->ptr;
}

template <typename T>
T &Box<T>::operator*() noexcept {
  return *this->ptr;
}

template <typename T>
template <typename... Fields>
Box<T> Box<T>::in_place(Fields &&...fields) {
  allocation alloc;
  auto ptr = alloc.ptr;
  ::new (ptr) T{std::forward<Fields>(fields)...};
  alloc.ptr = nullptr;
  return from_raw(ptr);
}

template <typename T>
void Box<T>::swap(Box &rhs) noexcept {
  using std::swap;
  swap(this->ptr, rhs.ptr);
}

template <typename T>
Box<T> Box<T>::from_raw(T *raw) noexcept {
  Box box = uninit{};
  box.ptr = raw;
  return box;
}

template <typename T>
T *Box<T>::into_raw() noexcept {
  T *raw = this->ptr;
  this->ptr = nullptr;
  return raw;
}

template <typename T>
Box<T>::Box(uninit) noexcept {}
#endif // CXXBRIDGE1_RUST_BOX

#ifndef CXXBRIDGE1_RUST_BITCOPY_T
#define CXXBRIDGE1_RUST_BITCOPY_T
struct unsafe_bitcopy_t final {
  explicit unsafe_bitcopy_t() = default;
};
#endif // CXXBRIDGE1_RUST_BITCOPY_T

#ifndef CXXBRIDGE1_RUST_VEC
#define CXXBRIDGE1_RUST_VEC
template <typename T>
class Vec final {
public:
  using value_type = T;

  Vec() noexcept;
  Vec(std::initializer_list<T>);
  Vec(const Vec &);
  Vec(Vec &&) noexcept;
  ~Vec() noexcept;

  Vec &operator=(Vec &&) & noexcept;
  Vec &operator=(const Vec &) &;

  std::size_t size() const noexcept;
  bool empty() const noexcept;
  const T *data() const noexcept;
  T *data() noexcept;
  std::size_t capacity() const noexcept;

  const T &operator[](std::size_t n) const noexcept;
  const T &at(std::size_t n) const;
  const T &front() const noexcept;
  const T &back() const noexcept;

  T &operator[](std::size_t n) noexcept;
  T &at(std::size_t n);
  T &front() noexcept;
  T &back() noexcept;

  void reserve(std::size_t new_cap);
  void push_back(const T &value);
  void push_back(T &&value);
  template <typename... Args>
  void emplace_back(Args &&...args);
  void truncate(std::size_t len);
  void clear();

  using iterator = typename Slice<T>::iterator;
  iterator begin() noexcept;
  iterator end() noexcept;

  using const_iterator = typename Slice<const T>::iterator;
  const_iterator begin() const noexcept;
  const_iterator end() const noexcept;
  const_iterator cbegin() const noexcept;
  const_iterator cend() const noexcept;

  void swap(Vec &) noexcept;

  Vec(unsafe_bitcopy_t, const Vec &) noexcept;

private:
  void reserve_total(std::size_t new_cap) noexcept;
  void set_len(std::size_t len) noexcept;
  void drop() noexcept;

  friend void swap(Vec &lhs, Vec &rhs) noexcept { lhs.swap(rhs); }

  std::array<std::uintptr_t, 3> repr;
};

template <typename T>
Vec<T>::Vec(std::initializer_list<T> init) : Vec{} {
  this->reserve_total(init.size());
  std::move(init.begin(), init.end(), std::back_inserter(*this));
}

template <typename T>
Vec<T>::Vec(const Vec &other) : Vec() {
  this->reserve_total(other.size());
  std::copy(other.begin(), other.end(), std::back_inserter(*this));
}

template <typename T>
Vec<T>::Vec(Vec &&other) noexcept : repr(other.repr) {
  new (&other) Vec();
}

template <typename T>
Vec<T>::~Vec() noexcept {
  this->drop();
}

template <typename T>
Vec<T> &Vec<T>::operator=(Vec &&other) & noexcept {
  this->drop();
  this->repr = other.repr;
  new (&other) Vec();
  return *this;
}

template <typename T>
Vec<T> &Vec<T>::operator=(const Vec &other) & {
  if (this != &other) {
    this->drop();
    new (this) Vec(other);
  }
  return *this;
}

template <typename T>
bool Vec<T>::empty() const noexcept {
  return this->size() == 0;
}

template <typename T>
const T &Vec<T>::operator[](std::size_t n) const noexcept {
  assert(n < this->size());
  auto data = reinterpret_cast<const char *>(this->data());
  return *reinterpret_cast<const T *>(data + n * size_of<T>());
}

template <typename T>
const T &Vec<T>::at(std::size_t n) const {
  if (n >= this->size()) {
    panic<std::out_of_range>("rust::Vec index out of range");
  }
  return (*this)[n];
}

template <typename T>
const T &Vec<T>::front() const noexcept {
  assert(!this->empty());
  return (*this)[0];
}

template <typename T>
const T &Vec<T>::back() const noexcept {
  assert(!this->empty());
  return (*this)[this->size() - 1];
}

template <typename T>
T &Vec<T>::operator[](std::size_t n) noexcept {
  assert(n < this->size());
  auto data = reinterpret_cast<char *>(this->data());
  return *reinterpret_cast<T *>(data + n * size_of<T>());
}

template <typename T>
T &Vec<T>::at(std::size_t n) {
  if (n >= this->size()) {
    panic<std::out_of_range>("rust::Vec index out of range");
  }
  return (*this)[n];
}

template <typename T>
T &Vec<T>::front() noexcept {
  assert(!this->empty());
  return (*this)[0];
}

template <typename T>
T &Vec<T>::back() noexcept {
  assert(!this->empty());
  return (*this)[this->size() - 1];
}

template <typename T>
void Vec<T>::reserve(std::size_t new_cap) {
  this->reserve_total(new_cap);
}

template <typename T>
void Vec<T>::push_back(const T &value) {
  this->emplace_back(value);
}

template <typename T>
void Vec<T>::push_back(T &&value) {
  this->emplace_back(std::move(value));
}

template <typename T>
template <typename... Args>
void Vec<T>::emplace_back(Args &&...args) {
  auto size = this->size();
  this->reserve_total(size + 1);
  ::new (reinterpret_cast<T *>(reinterpret_cast<char *>(this->data()) +
                               size * size_of<T>()))
      T(std::forward<Args>(args)...);
  this->set_len(size + 1);
}

template <typename T>
void Vec<T>::clear() {
  this->truncate(0);
}

template <typename T>
typename Vec<T>::iterator Vec<T>::begin() noexcept {
  return Slice<T>(this->data(), this->size()).begin();
}

template <typename T>
typename Vec<T>::iterator Vec<T>::end() noexcept {
  return Slice<T>(this->data(), this->size()).end();
}

template <typename T>
typename Vec<T>::const_iterator Vec<T>::begin() const noexcept {
  return this->cbegin();
}

template <typename T>
typename Vec<T>::const_iterator Vec<T>::end() const noexcept {
  return this->cend();
}

template <typename T>
typename Vec<T>::const_iterator Vec<T>::cbegin() const noexcept {
  return Slice<const T>(this->data(), this->size()).begin();
}

template <typename T>
typename Vec<T>::const_iterator Vec<T>::cend() const noexcept {
  return Slice<const T>(this->data(), this->size()).end();
}

template <typename T>
void Vec<T>::swap(Vec &rhs) noexcept {
  using std::swap;
  swap(this->repr, rhs.repr);
}

template <typename T>
Vec<T>::Vec(unsafe_bitcopy_t, const Vec &bits) noexcept : repr(bits.repr) {}
#endif // CXXBRIDGE1_RUST_VEC

#ifndef CXXBRIDGE1_RUST_OPAQUE
#define CXXBRIDGE1_RUST_OPAQUE
class Opaque {
public:
  Opaque() = delete;
  Opaque(const Opaque &) = delete;
  ~Opaque() = delete;
};
#endif // CXXBRIDGE1_RUST_OPAQUE

#ifndef CXXBRIDGE1_IS_COMPLETE
#define CXXBRIDGE1_IS_COMPLETE
namespace detail {
namespace {
template <typename T, typename = std::size_t>
struct is_complete : std::false_type {};
template <typename T>
struct is_complete<T, decltype(sizeof(T))> : std::true_type {};
} // namespace
} // namespace detail
#endif // CXXBRIDGE1_IS_COMPLETE

#ifndef CXXBRIDGE1_LAYOUT
#define CXXBRIDGE1_LAYOUT
class layout {
  template <typename T>
  friend std::size_t size_of();
  template <typename T>
  friend std::size_t align_of();
  template <typename T>
  static typename std::enable_if<std::is_base_of<Opaque, T>::value,
                                 std::size_t>::type
  do_size_of() {
    return T::layout::size();
  }
  template <typename T>
  static typename std::enable_if<!std::is_base_of<Opaque, T>::value,
                                 std::size_t>::type
  do_size_of() {
    return sizeof(T);
  }
  template <typename T>
  static
      typename std::enable_if<detail::is_complete<T>::value, std::size_t>::type
      size_of() {
    return do_size_of<T>();
  }
  template <typename T>
  static typename std::enable_if<std::is_base_of<Opaque, T>::value,
                                 std::size_t>::type
  do_align_of() {
    return T::layout::align();
  }
  template <typename T>
  static typename std::enable_if<!std::is_base_of<Opaque, T>::value,
                                 std::size_t>::type
  do_align_of() {
    return alignof(T);
  }
  template <typename T>
  static
      typename std::enable_if<detail::is_complete<T>::value, std::size_t>::type
      align_of() {
    return do_align_of<T>();
  }
};

template <typename T>
std::size_t size_of() {
  return layout::size_of<T>();
}

template <typename T>
std::size_t align_of() {
  return layout::align_of<T>();
}
#endif // CXXBRIDGE1_LAYOUT
} // namespace cxxbridge1
} // namespace rust

#if __cplusplus >= 201402L
#define CXX_DEFAULT_VALUE(value) = value
#else
#define CXX_DEFAULT_VALUE(value)
#endif

namespace kvlink {
  namespace ffi {
    struct EngineOptions;
    struct RegionStatus;
    struct BufferInfo;
    struct AdvertInfo;
    struct NotificationInfo;
    struct HealthInfo;
    struct EngineHandle;
  }
}

namespace kvlink {
namespace ffi {
#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$EngineOptions
#define CXXBRIDGE1_STRUCT_kvlink$ffi$EngineOptions
// How to build one rank's engine.
struct EngineOptions final {
  // Agent name, sent to peers in the hello.
  ::rust::String name;
  // This rank's id, unique across both engines of a deployment.
  ::std::uint32_t rank CXX_DEFAULT_VALUE(0);
  // "tcp", "sm" (shared memory), "auto" or a UCX transport list ("rc,cuda_copy"), with
  // "@devices" for network devices ("tcp@eth0").
  ::rust::String transport;
  // tcp: `ip:port` to listen on (port 0 picks one); empty for none.
  ::rust::String listen;
  // Per-request deadline (TensorRT-LLM's kv_transfer_timeout_ms). Must be positive.
  ::std::uint64_t timeout_ms CXX_DEFAULT_VALUE(0);
  // Extra time past a deadline for ranks to agree (0: the default, 50 ms).
  ::std::uint64_t agreement_ms CXX_DEFAULT_VALUE(0);
  // How long a request that ended without completing is kept whole past its end, when
  // `has_linger` (else the default, 5 000 ms); 0: forgotten at its end.
  bool has_linger CXX_DEFAULT_VALUE(false);
  ::std::uint64_t linger_ms CXX_DEFAULT_VALUE(0);
  // health().state windows (0: the defaults, 10 000 and 60 000 ms).
  ::std::uint64_t wedge_ms CXX_DEFAULT_VALUE(0);
  ::std::uint64_t degraded_ms CXX_DEFAULT_VALUE(0);
  // Fault hook: the request id whose data a sender silently drops; -1 for none.
  ::std::int64_t fault_suppress_request CXX_DEFAULT_VALUE(0);
  // The deployment secret, when `has_secret` (else `KVLINK_SECRET` from the environment).
  bool has_secret CXX_DEFAULT_VALUE(false);
  ::rust::Vec<::std::uint8_t> secret;

  using IsRelocatable = ::std::true_type;
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$EngineOptions

#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$RegionStatus
#define CXXBRIDGE1_STRUCT_kvlink$ffi$RegionStatus
// A region now (see `Engine::region_info`).
struct RegionStatus final {
  ::std::uint64_t addr CXX_DEFAULT_VALUE(0);
  ::std::uint64_t len CXX_DEFAULT_VALUE(0);
  ::std::uint64_t transfers CXX_DEFAULT_VALUE(0);
  ::std::uint64_t fenced_transfers CXX_DEFAULT_VALUE(0);
  ::std::uint64_t fenced_bytes CXX_DEFAULT_VALUE(0);

  using IsRelocatable = ::std::true_type;
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$RegionStatus

#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$BufferInfo
#define CXXBRIDGE1_STRUCT_kvlink$ffi$BufferInfo
// One advertised buffer.
struct BufferInfo final {
  // 0 KV, 1 KV indexer, 2 RNN.
  ::std::uint8_t kind CXX_DEFAULT_VALUE(0);
  ::std::uint32_t segment CXX_DEFAULT_VALUE(0);
  ::std::uint64_t addr CXX_DEFAULT_VALUE(0);
  ::std::uint64_t len CXX_DEFAULT_VALUE(0);
  // CUDA device, -1 for host memory.
  ::std::int32_t device_id CXX_DEFAULT_VALUE(0);
  // Set by kvlink (the receive's token, from which its UCX tag is keyed); ignored on input.
  ::std::uint64_t token CXX_DEFAULT_VALUE(0);

  using IsRelocatable = ::std::true_type;
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$BufferInfo

#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$AdvertInfo
#define CXXBRIDGE1_STRUCT_kvlink$ffi$AdvertInfo
// An advertisement taken by a context rank; `found` is false when none came in time.
struct AdvertInfo final {
  bool found CXX_DEFAULT_VALUE(false);
  ::std::uint64_t request CXX_DEFAULT_VALUE(0);
  ::std::uint32_t generation CXX_DEFAULT_VALUE(0);
  ::std::uint32_t from_rank CXX_DEFAULT_VALUE(0);
  // Milliseconds left, when it was taken, until the request's deadline.
  ::std::uint64_t deadline_ms CXX_DEFAULT_VALUE(0);
  ::rust::Vec<::std::uint8_t> request_info;
  ::rust::Vec<::kvlink::ffi::BufferInfo> buffers;

  using IsRelocatable = ::std::true_type;
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$AdvertInfo

#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$NotificationInfo
#define CXXBRIDGE1_STRUCT_kvlink$ffi$NotificationInfo
// A notification; `found` is false when none came in time.
struct NotificationInfo final {
  bool found CXX_DEFAULT_VALUE(false);
  ::std::uint64_t request CXX_DEFAULT_VALUE(0);
  ::std::uint32_t generation CXX_DEFAULT_VALUE(0);
  ::rust::Vec<::std::uint8_t> payload;

  using IsRelocatable = ::std::true_type;
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$NotificationInfo

#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$HealthInfo
#define CXXBRIDGE1_STRUCT_kvlink$ffi$HealthInfo
// The progress snapshot (see `kvlink::Health` in engine.hpp).
struct HealthInfo final {
  // 0 Healthy, 1 Degraded, 2 Wedged.
  ::std::uint8_t state CXX_DEFAULT_VALUE(0);
  ::std::uint64_t since_last_fault_ms CXX_DEFAULT_VALUE(0);
  ::std::uint64_t peers CXX_DEFAULT_VALUE(0);
  ::std::uint64_t peers_failed CXX_DEFAULT_VALUE(0);
  ::std::uint64_t requests_known CXX_DEFAULT_VALUE(0);
  ::std::uint64_t completed CXX_DEFAULT_VALUE(0);
  ::std::uint64_t failed CXX_DEFAULT_VALUE(0);
  ::std::uint64_t stale_dropped CXX_DEFAULT_VALUE(0);
  ::std::uint64_t bad_frames CXX_DEFAULT_VALUE(0);
  ::std::uint64_t buffers_leased CXX_DEFAULT_VALUE(0);
  ::std::uint64_t buffers_fenced CXX_DEFAULT_VALUE(0);
  ::std::uint64_t ops_in_flight CXX_DEFAULT_VALUE(0);
  ::std::uint64_t oldest_op_ms CXX_DEFAULT_VALUE(0);
  ::std::uint64_t since_last_completion_ms CXX_DEFAULT_VALUE(0);
  ::std::uint64_t bytes_completed CXX_DEFAULT_VALUE(0);
  ::std::uint64_t unreaped_ops CXX_DEFAULT_VALUE(0);
  ::std::uint64_t peers_reconnecting CXX_DEFAULT_VALUE(0);
  ::std::uint64_t reconnects CXX_DEFAULT_VALUE(0);
  ::std::uint64_t adverts_refused CXX_DEFAULT_VALUE(0);
  ::std::uint64_t notes_dropped CXX_DEFAULT_VALUE(0);
  ::std::uint64_t unsettled_returns CXX_DEFAULT_VALUE(0);
  ::std::uint64_t foreign_data CXX_DEFAULT_VALUE(0);
  ::std::uint64_t late_data CXX_DEFAULT_VALUE(0);
  ::std::uint64_t refused_auth CXX_DEFAULT_VALUE(0);
  ::std::uint64_t refused_rank_in_use CXX_DEFAULT_VALUE(0);
  ::std::uint64_t refused_version CXX_DEFAULT_VALUE(0);
  ::std::uint64_t refused_by_peer CXX_DEFAULT_VALUE(0);
  // This process's shared-memory receive queue is stuck (see `kvlink::Health`).
  bool receive_stuck CXX_DEFAULT_VALUE(false);
  // Moves to a new worker after a stuck receive queue (see `kvlink::Health`).
  ::std::uint64_t worker_renewals CXX_DEFAULT_VALUE(0);
  // Region bytes fenced now, and transfers fenced that way so far.
  ::std::uint64_t region_fenced_bytes CXX_DEFAULT_VALUE(0);
  ::std::uint64_t region_fences CXX_DEFAULT_VALUE(0);
  // Control messages resent, repeats dropped, messages for unknown requests dropped.
  ::std::uint64_t resends CXX_DEFAULT_VALUE(0);
  ::std::uint64_t duplicates CXX_DEFAULT_VALUE(0);
  ::std::uint64_t unknown_dropped CXX_DEFAULT_VALUE(0);
  // Votes and failure verdicts kept for a request not yet started here; ranks forgotten
  // to bound the peer table (see `kvlink::Health`).
  ::std::uint64_t early_kept CXX_DEFAULT_VALUE(0);
  ::std::uint64_t ranks_forgotten CXX_DEFAULT_VALUE(0);
  // Connections whose peer said it was leaving (see `kvlink::Health`).
  ::std::uint64_t peers_left CXX_DEFAULT_VALUE(0);

  using IsRelocatable = ::std::true_type;
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$HealthInfo

#ifndef CXXBRIDGE1_STRUCT_kvlink$ffi$EngineHandle
#define CXXBRIDGE1_STRUCT_kvlink$ffi$EngineHandle
// One rank's engine: UCX agent, protocol core, driver thread.
struct EngineHandle final : public ::rust::Opaque {
  ::rust::String address() const;
  ::std::uint32_t rank() const noexcept;
  ::std::uint32_t connect(::rust::Str address, ::std::uint64_t timeout_ms) const;
  void wait_peer(::std::uint32_t rank, ::std::uint64_t timeout_ms) const;
  void advertise(::std::uint64_t request, ::std::uint32_t generation, ::rust::Slice<::std::uint32_t const> receivers, ::std::uint32_t sender, ::rust::Slice<::kvlink::ffi::BufferInfo const> buffers, ::rust::Slice<::std::uint8_t const> request_info) const;

  // One request filled by several context ranks: `senders[i]` sends `buffers[i]`.
  // `timeout_ms`: the request's own deadline from now (0: the engine's timeout).
  void advertise_flows(::std::uint64_t request, ::std::uint32_t generation, ::rust::Slice<::std::uint32_t const> receivers, ::rust::Slice<::std::uint32_t const> senders, ::rust::Slice<::kvlink::ffi::BufferInfo const> buffers, ::rust::Slice<::std::uint8_t const> request_info, ::std::uint64_t timeout_ms) const;

  ::kvlink::ffi::AdvertInfo next_advertisement(::std::uint64_t timeout_ms, ::std::size_t cancel) const;
  void accept(::std::uint64_t request, ::std::uint32_t generation, ::std::uint32_t from_rank, bool ready) const;
  ::std::int8_t recv_ready(::std::uint64_t request, ::std::uint32_t generation, ::std::uint64_t timeout_ms, ::std::size_t cancel) const;
  ::std::uint8_t send(::std::uint64_t request, ::std::uint32_t generation, ::std::uint32_t to_rank, ::std::uint32_t segment, ::std::uint8_t const *data, ::std::size_t len, ::std::uint64_t timeout_ms, ::std::size_t cancel) const;

  // `send` of CUDA device memory (staged through pinned host memory).
  ::std::uint8_t send_device(::std::uint64_t request, ::std::uint32_t generation, ::std::uint32_t to_rank, ::std::uint32_t segment, ::std::int32_t device, ::std::uint64_t device_addr, ::std::size_t len, ::std::uint64_t timeout_ms, ::std::size_t cancel) const;

  ::std::uint8_t wait(::std::uint64_t request, ::std::uint32_t generation, bool as_receiver, ::std::uint32_t peer_rank, ::std::uint64_t timeout_ms, ::std::size_t cancel) const;
  void cancel(::std::uint64_t request, ::std::uint32_t generation) const;
  void notify(::std::uint32_t to_rank, ::std::uint64_t request, ::std::uint32_t generation, ::rust::Slice<::std::uint8_t const> payload) const;
  ::kvlink::ffi::NotificationInfo wait_for_notification(::std::uint32_t from_rank, ::std::uint64_t timeout_ms, ::std::size_t cancel) const;
  ::kvlink::ffi::HealthInfo health() const;

  // The engine's metrics in the Prometheus text format (version 0.0.4).
  ::rust::String metrics_text() const;

  // The connection to `rank`: 0 unknown, 1 connected, 2 reconnecting, 3 failed.
  ::std::uint8_t peer_state(::std::uint32_t rank) const;

  // How CUDA memory moves with this engine's UCX, asked of it at start: 0 staged through
  // pinned host buffers, 1 direct (UCX reports CUDA memory support).
  ::std::uint8_t device_path() const noexcept;

  // Lends `[addr, addr + len)` to the engine as a region; returns its id.
  ::std::uint64_t register_region(::std::uint64_t addr, ::std::uint64_t len) const;

  // The address of `len` bytes at `offset` in a region (OutOfBounds past its end).
  ::std::uint64_t region_address(::std::uint64_t region, ::std::uint64_t offset, ::std::uint64_t len) const;

  ::kvlink::ffi::RegionStatus region_info(::std::uint64_t region) const;

  // The region's fenced ranges, flattened: offset, length, offset, length, ...
  ::rust::Vec<::std::uint64_t> region_fenced_ranges(::std::uint64_t region) const;

  void deregister_region(::std::uint64_t region, ::std::uint64_t timeout_ms) const;
  ~EngineHandle() = delete;

private:
  friend ::rust::layout;
  struct layout {
    static ::std::size_t size() noexcept;
    static ::std::size_t align() noexcept;
  };
};
#endif // CXXBRIDGE1_STRUCT_kvlink$ffi$EngineHandle

// The library version (Cargo package version).
::rust::String version() noexcept;

// The UCX library kvlink runs on, as it reports itself (`ucp_get_version`): "1.22.0".
::rust::String ucx_version() noexcept;

// Kind code (see `kvlink::ErrorKind`) of the last error thrown on this thread; 0 if none.
// Reading clears it.
::std::uint8_t take_last_error_kind() noexcept;

// Stable name of an error kind code ("InvalidArgument", ...), "Unknown" for others.
::rust::Str error_kind_name(::std::uint8_t code) noexcept;

// Parses and checks an `ip:port` listen address; returns its canonical form.
// Throws InvalidArgument on anything else.
::rust::String check_listen_address(::rust::Str addr);

// Routes kvlink's log events at or above `level` (1 error .. 5 trace) to `callback`,
// the address of an `extern "C"` function (level, target, message and fields as
// pointer + length each) instead of stderr; level 0 or callback 0 removes it. Returns
// false when a global `tracing` subscriber of the host's came first (events go there).
// cxx cannot pass a function pointer from C++ to Rust, so it travels as an address.
bool set_log_sink(::std::uint8_t level, ::std::size_t callback);

// Log records dropped because the sink fell `kvlink::log::QUEUE_CAP` records behind, or
// because formatting one panicked, since the process started.
::std::uint64_t log_records_dropped() noexcept;

// Waits up to `timeout_ms` until the log records queued so far have reached the sink;
// returns whether they all have.
bool flush_log(::std::uint64_t timeout_ms);

::rust::Box<::kvlink::ffi::EngineHandle> engine_new(::kvlink::ffi::EngineOptions const &options);
} // namespace ffi
} // namespace kvlink

#ifdef __clang__
#pragma clang diagnostic pop
#endif // __clang__
